//! The ways a request reaches a decision. Each surface only translates its
//! input into counters and the decision back into its own wire format.

pub mod proxy;
