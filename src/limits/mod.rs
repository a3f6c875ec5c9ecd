//! What the loaded limits say about a request: which rules apply, and which
//! counter each one charges.
//!
//! Surfaces translate their wire format into facts ([`RequestInfo`] for an
//! HTTP request, [`Descriptor`]s for an Envoy RLS call); [`http::hits`] and
//! [`descriptors::resolve`] turn them into [`Hit`](crate::limiter::Hit)s for
//! the limiter, with counter keys ([`keys`]) shared by every surface.

pub mod catalog;
pub mod descriptors;
pub mod http;
pub mod keys;

pub use catalog::{Catalog, SharedCatalog};
pub use descriptors::{Descriptor, Override, Resolved, resolve};
pub use http::{RequestError, RequestInfo, hits, request_host};
