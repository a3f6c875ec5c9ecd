//! The ways a request reaches a decision. Each surface only translates its
//! input into counters and the decision back into its own wire format; the
//! limiter decides for all of them.

#[cfg_attr(
    not(test),
    deny(
        clippy::indexing_slicing,
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::arithmetic_side_effects
    )
)]
pub mod body;
#[cfg_attr(
    not(test),
    deny(
        clippy::indexing_slicing,
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::arithmetic_side_effects
    )
)]
pub mod decision_http;
#[cfg_attr(
    not(test),
    deny(
        clippy::indexing_slicing,
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::arithmetic_side_effects
    )
)]
pub mod envoy_rls;
#[cfg_attr(
    not(test),
    deny(
        clippy::indexing_slicing,
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::arithmetic_side_effects
    )
)]
pub mod proxy;
pub mod upstream_pool;
