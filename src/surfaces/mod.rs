//! The ways a request reaches a decision. Each surface only translates its
//! input into counters and the decision back into its own wire format; the
//! limiter decides for all of them.

request_path! {
    pub mod decision_http;
    pub mod envoy_rls;
    pub mod proxy;
    pub mod rls_wire;
}
