//! How Envoy's `ShouldRateLimit` calls are read off the wire. prost refuses
//! a message whose `string` fields are not UTF-8 and tonic then fails the
//! whole call (INTERNAL): one descriptor value with a `0x80` byte (Envoy
//! passes such header bytes through, and its protobuf serialises them) left
//! every other descriptor of the request unchecked and uncharged, and
//! Envoy, failing open by default, let the request through. Here such a
//! text is read with each byte that is not UTF-8 written `\xHH`: a value of
//! its own, limited as any other. The service is otherwise the one
//! envoy-types generates: same name, same method, responses as tonic-prost
//! writes them.

use std::sync::Arc;
use std::task::{Context, Poll};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{Entry, RateLimitOverride};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use prost::Message;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::codegen::{Body, BoxFuture, Service, StdError, http};
use tonic_prost::ProstEncoder;

use super::envoy_rls::RlsService;
use crate::metrics::{self, Surface};

/// The gRPC method Envoy calls.
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// `RateLimitRequest` as it is on the wire, its texts as bytes.
#[derive(Clone, PartialEq, Message)]
struct WireRequest {
    #[prost(bytes = "vec", tag = "1")]
    domain: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    descriptors: Vec<WireDescriptor>,
    #[prost(uint32, tag = "3")]
    hits_addend: u32,
}

/// `RateLimitDescriptor` as it is on the wire.
#[derive(Clone, PartialEq, Message)]
struct WireDescriptor {
    #[prost(message, repeated, tag = "1")]
    entries: Vec<WireEntry>,
    #[prost(message, optional, tag = "2")]
    limit: Option<RateLimitOverride>,
    #[prost(message, optional, tag = "3")]
    hits_addend: Option<UInt64Value>,
    #[prost(bool, tag = "4")]
    is_negative_hits: bool,
}

/// A descriptor entry as it is on the wire.
#[derive(Clone, PartialEq, Message)]
struct WireEntry {
    #[prost(bytes = "vec", tag = "1")]
    key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

/// `bytes` as text: as they are when UTF-8 (no copy), else with each byte
/// that is not written `\xHH`.
fn text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| {
        let bytes = e.into_bytes();
        let mut out = String::with_capacity(bytes.len().saturating_mul(2));
        for chunk in bytes.utf8_chunks() {
            out.push_str(chunk.valid());
            for b in chunk.invalid() {
                out.push_str(&format!("\\x{b:02X}"));
            }
        }
        out
    })
}

impl From<WireRequest> for RateLimitRequest {
    fn from(w: WireRequest) -> Self {
        RateLimitRequest {
            domain: text(w.domain),
            descriptors: w
                .descriptors
                .into_iter()
                .map(|d| RateLimitDescriptor {
                    entries: d
                        .entries
                        .into_iter()
                        .map(|e| Entry {
                            key: text(e.key),
                            value: text(e.value),
                        })
                        .collect(),
                    limit: d.limit,
                    hits_addend: d.hits_addend,
                    is_negative_hits: d.is_negative_hits,
                })
                .collect(),
            hits_addend: w.hits_addend,
        }
    }
}

/// Reads requests leniently (see the module's comment); writes responses
/// as tonic-prost does.
#[derive(Default)]
struct RlsCodec;

/// Reads one `RateLimitRequest`.
struct RequestDecoder;

impl Decoder for RequestDecoder {
    type Item = RateLimitRequest;
    type Error = tonic::Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<RateLimitRequest>, tonic::Status> {
        match WireRequest::decode(buf) {
            Ok(wire) => Ok(Some(wire.into())),
            Err(e) => {
                // What tonic answers for a message that is not protobuf.
                metrics::get().request(Surface::Rls, metrics::Answer::BadRequest);
                tracing::debug!(error = %e, "an RLS request could not be decoded");
                Err(tonic::Status::internal(format!("failed to decode the request: {e}")))
            }
        }
    }
}

impl Codec for RlsCodec {
    type Encode = RateLimitResponse;
    type Decode = RateLimitRequest;
    type Encoder = ProstEncoder<RateLimitResponse>;
    type Decoder = RequestDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        RequestDecoder
    }
}

/// Envoy's rate limit service, as tonic serves it.
#[derive(Clone)]
pub struct RlsServer(Arc<RlsService>);

impl RlsServer {
    /// Serves `rls`.
    pub fn new(rls: RlsService) -> Self {
        RlsServer(Arc::new(rls))
    }
}

impl tonic::server::NamedService for RlsServer {
    const NAME: &'static str = "envoy.service.ratelimit.v3.RateLimitService";
}

/// The one method, as tonic calls it.
struct ShouldRateLimit(Arc<RlsService>);

impl tonic::server::UnaryService<RateLimitRequest> for ShouldRateLimit {
    type Response = RateLimitResponse;
    type Future = BoxFuture<tonic::Response<RateLimitResponse>, tonic::Status>;

    fn call(&mut self, request: tonic::Request<RateLimitRequest>) -> Self::Future {
        let rls = self.0.clone();
        Box::pin(async move { rls.should_rate_limit(request).await })
    }
}

impl<B> Service<http::Request<B>> for RlsServer
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != SHOULD_RATE_LIMIT {
            return Box::pin(async move {
                let mut response = http::Response::new(tonic::body::Body::default());
                let headers = response.headers_mut();
                headers.insert(tonic::Status::GRPC_STATUS, (tonic::Code::Unimplemented as i32).into());
                headers.insert(http::header::CONTENT_TYPE, tonic::metadata::GRPC_CONTENT_TYPE);
                Ok(response)
            });
        }
        let method = ShouldRateLimit(self.0.clone());
        Box::pin(async move { Ok(tonic::server::Grpc::new(RlsCodec).unary(method, req).await) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_reads_as_prost_reads_it_and_bytes_that_are_not_utf8_as_escapes() {
        let whole = RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "user".into(),
                    value: "zoë".into(),
                }],
                limit: Some(RateLimitOverride {
                    requests_per_unit: 7,
                    unit: 2,
                }),
                hits_addend: Some(UInt64Value { value: 3 }),
                is_negative_hits: true,
            }],
            hits_addend: 9,
        };
        let read: RateLimitRequest = WireRequest::decode(whole.encode_to_vec().as_slice()).unwrap().into();
        assert_eq!(read, whole);

        let raw = WireRequest {
            domain: b"edge".to_vec(),
            descriptors: vec![WireDescriptor {
                entries: vec![WireEntry {
                    key: b"k".to_vec(),
                    value: b"caf\x80\xff\xc3\xa9".to_vec(),
                }],
                ..Default::default()
            }],
            hits_addend: 1,
        };
        assert!(RateLimitRequest::decode(raw.encode_to_vec().as_slice()).is_err(), "prost refuses it");
        let read: RateLimitRequest = WireRequest::decode(raw.encode_to_vec().as_slice()).unwrap().into();
        assert_eq!(read.descriptors[0].entries[0].value, "caf\\x80\\xFFé");
    }
}
