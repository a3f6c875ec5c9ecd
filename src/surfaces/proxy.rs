//! The reverse proxy surface: decide, then forward to the upstream or refuse.
//!
//! Translation only: the request becomes a [`RequestInfo`], the limiter
//! decides, and the decision becomes either the upstream's own response
//! (streamed both ways, never buffered) or a refusal with RateLimit headers.
//! Hop-by-hop headers are dropped in both directions (RFC 9110 §7.6.1);
//! WebSocket and other upgrades are joined end to end after the handshake.

// A plain GET's map is empty: its fields are read through `fields`.
#![deny(clippy::disallowed_methods)]

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode, Uri, Version};
use http_body_util::Either;
use hyper::body::Body as _;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;

use crate::client_ip::TrustedProxies;
use crate::fields::Fields;
use crate::limits::RequestInfo;
use crate::render;
use crate::serve::{RequestBody, fields};
use crate::limiter::{Decision, Limiter};
use crate::metrics::{self, Surface};
use crate::limits::SharedCatalog;
use crate::serve::{WholeBody, WrittenFields};
use crate::upstream::{BodyProgress, ClientBody, SendError, Upstream, UpstreamBody, UpstreamFields, UpstreamPool};

/// What the proxy answers with: the upstream's body, or one of our own.
pub type ProxyBody = Either<UpstreamBody, WholeBody>;

/// Headers that describe one connection, never the message (RFC 9110 §7.6.1),
/// `HTTP2-Settings`, which only an `Upgrade: h2c` (never forwarded) uses,
/// and `Proxy-*` (`Proxy-Connection`, `Proxy-Authorization`...: meant for a
/// proxy, never passed on) with `Proxy` itself, which CGI-style servers
/// read as their `HTTP_PROXY` setting (httpoxy).
/// One list, [`Relay::of`]'s, for a map's names and for names as they came.
fn is_hop_by_hop(name: &str) -> bool {
    Relay::of(name.as_bytes()).is_hop_by_hop()
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Other ways a request claims who the client is and how it came (Rack
/// reads `X-Forwarded-Ssl` before `X-Forwarded-Proto`, Spring `Forwarded`,
/// NGINX's real_ip `X-Real-IP`, Envoy's `X-Forwarded-Client-Cert`, Rails'
/// `remote_ip` `Client-IP`, PHP code `X-Client-IP`, Akamai's
/// `True-Client-IP`...): believed only from a trusted proxy, as
/// `X-Forwarded-Proto` is. What it asked for (`X-Original-URL`...) is
/// believed from no one: see [`is_target_claim`].
fn is_scheme_claim(name: &[u8]) -> bool {
    matches!(
        name,
        b"x-real-ip"
            | b"x-forwarded-client-cert"
            | b"forwarded"
            | b"x-forwarded-ssl"
            | b"x-forwarded-scheme"
            | b"x-forwarded-protocol"
            | b"front-end-https"
            | b"x-forwarded-port"
            | b"x-url-scheme"
            | b"client-ip"
            | b"x-client-ip"
            | b"true-client-ip"
            | b"x-cluster-client-ip"
    )
}

/// Settings of the proxy surface.
#[derive(Debug, Clone)]
pub struct ProxyOptions {
    /// Where admitted requests go.
    pub upstream: Upstream,
    /// Longest wait for the upstream's response headers, once the request
    /// has been sent whole, before answering 504.
    pub upstream_timeout: Duration,
    /// Longest wait between two frames of a body, either way.
    pub body_timeout: Duration,
    /// Most idle upstream connections kept per proxy thread.
    pub upstream_keepalive: usize,
    /// How long an idle upstream connection is kept.
    pub upstream_keepalive_timeout: Duration,
    /// Whose forwarding headers are believed.
    pub trusted: TrustedProxies,
    /// Whether admitted responses carry RateLimit headers.
    pub ratelimit_headers: bool,
}

/// The proxy: shared by every connection.
pub struct Proxy {
    limiter: Arc<Limiter>,
    catalog: SharedCatalog,
    pool: UpstreamPool,
    options: ProxyOptions,
}

/// The upstream's failures, told at most once a second for the process:
/// an upstream down fails every request, and a line each buried the log
/// (thousands a second). `failures` on each line counts the requests it
/// stands for.
static UPSTREAM_FAILURES: crate::log_every::Folded = crate::log_every::Folded::new();

/// One more upstream failure: how many failed requests the line its
/// caller writes now stands for, when one is due. Failures from before a
/// second without any, not told yet, are told first, apart: they may have
/// had another cause.
/// `cause` is kept for the line that tells this one, when it is folded.
fn upstream_failed(cause: impl FnOnce() -> String) -> Option<u64> {
    let (earlier, now) = UPSTREAM_FAILURES.failed(false, cause);
    if let Some(t) = earlier {
        tracing::warn!(failures = t.failures(), last_error = %t.cause, "upstream failures before the last second, not told yet");
    }
    now.map(|t| t.failures())
}

/// Tells the upstream failures no line has told yet, as the process stops
/// (no later answer will): the lines add up to every failed request.
pub fn tell_untold_failures() {
    if let Some(t) = UPSTREAM_FAILURES.untold() {
        tracing::warn!(failures = t.failures(), last_error = %t.cause, "upstream failures since the last line, told at shutdown");
    }
}

/// Why the wait for the upstream ended before its answer.
enum Waited {
    /// Nothing of the request's body was taken for this long (the
    /// connection never came up, or the upstream stopped reading).
    NotTaken(Duration),
    /// No answer within `--upstream-timeout` of the request sent whole.
    NoAnswer,
}

impl Proxy {
    /// A proxy deciding with `limiter` against the live limits in `catalog`.
    pub fn new(limiter: Arc<Limiter>, catalog: SharedCatalog, options: ProxyOptions) -> Self {
        // No time to keep a connection is none kept at all, rather than
        // each kept until the next sweep unused.
        let keep = match options.upstream_keepalive_timeout.is_zero() {
            true => 0,
            false => options.upstream_keepalive,
        };
        let pool = UpstreamPool::new(
            &options.upstream,
            options.upstream_keepalive_timeout,
            keep,
            options.body_timeout,
        );
        Proxy {
            limiter,
            catalog,
            pool,
            options,
        }
    }

    /// Handles one client request: decide, then forward or refuse.
    /// Owns its handle on the proxy, so a listener's handler returns this
    /// future itself, not one more future wrapping it.
    pub async fn handle(self: Arc<Self>, req: Request<RequestBody>, peer: SocketAddr) -> Response<ProxyBody> {
        let version = req.version();
        // A reverse proxy has no use for a forward proxy's tunnel (CONNECT)
        // or a question to the server as a whole (`OPTIONS *`): neither has
        // a path to limit or to forward (it went upstream as `/*`, or as a
        // CONNECT to nowhere and an empty reply). NGINX answers both 400.
        if req.method() == http::Method::CONNECT || req.uri().path() == "*" {
            metrics::get().request(Surface::Proxy, metrics::Answer::BadRequest);
            return closing(plain(StatusCode::BAD_REQUEST, "CONNECT and OPTIONS * are not proxied"), version);
        }
        // hyper takes `gzip, chunked` and decodes only the chunks: passed on,
        // the upstream would read gzip bytes as the body. NGINX answers 501
        // to any coding but chunked.
        // (Only a request with a body can carry one: most have none.)
        if !req.body().is_end_stream()
            && fields(&req).contains(&header::TRANSFER_ENCODING)
            && !only_token_in(fields(&req).get_all(&header::TRANSFER_ENCODING), b"chunked")
        {
            metrics::get().request(Surface::Proxy, metrics::Answer::BadRequest);
            return closing(plain(StatusCode::NOT_IMPLEMENTED, "only the chunked transfer coding is supported"), version);
        }
        // A gRPC caller's deadline counts from here: tollgate never makes it
        // wait past it (DEADLINE_EXCEEDED, as Envoy answers).
        let grpc = render::is_grpc(fields(&req));
        let deadline = match grpc.then(|| render::grpc_deadline(fields(&req))) {
            None | Some(Ok(None)) => None,
            Some(Ok(Some(d))) => Some(tokio::time::Instant::now().checked_add(d)),
            // Answered here, as a gRPC server would (INTERNAL): passed on,
            // grpc-core servers fail every later call on the shared upstream
            // connection that carries a new grpc-timeout value.
            Some(Err(e)) => {
                metrics::get().request(Surface::Proxy, metrics::Answer::BadRequest);
                return grpc_status(tonic::Code::Internal, &e.to_string());
            }
        };
        let call = Call {
            // The caller's deadline, when it set one, bounds the wait for
            // the upstream instead of --upstream-timeout (longer or shorter).
            caller_bounds: deadline.is_some(),
            // gRPC is HTTP/2 end to end: a call that came over it goes on
            // over it whatever the upstream's scheme (grpc_pass, Envoy's
            // http2 cluster).
            needs_h2: grpc && req.version() == Version::HTTP_2,
        };
        // Pinned where it is made: awaited by value, the whole future (the
        // decision's and the upstream exchange's states, ~KBs) was copied
        // once more every request.
        // When a call with a deadline went upstream: its deadline passed
        // after that is the upstream's timeout, counted and logged as one.
        let forwarded = std::sync::OnceLock::new();
        let answer = std::pin::pin!(async {
            let admitted = self.decide(&req, peer).await?;
            if matches!(deadline, Some(Some(_))) {
                let _ = forwarded.set(Instant::now());
            }
            self.forward(req, peer, admitted, call).await
        });
        let answer = match deadline.flatten() {
            None => answer.await,
            Some(deadline) => match tokio::time::timeout_at(deadline, answer).await {
                Ok(answer) => answer,
                Err(_) => {
                    match forwarded.get() {
                        Some(&began) => {
                            metrics::get().upstream("timeout", began.elapsed());
                            if let Some(failures) = upstream_failed(|| "timed out (the call's grpc-timeout passed)".into()) {
                                tracing::warn!(upstream = %self.options.upstream.authority(), failures, "upstream timed out (the call's grpc-timeout passed)");
                            }
                        }
                        None => tracing::info!("a call's grpc-timeout passed before it was decided"),
                    }
                    Err(grpc_failure(StatusCode::GATEWAY_TIMEOUT, "the call's grpc-timeout passed"))
                }
            },
        };
        match answer {
            Ok(response) => response,
            // tollgate's own answers, as a gRPC client can tell them apart:
            // a bad request is INVALID_ARGUMENT (a bare 400 reads as
            // INTERNAL), an unreachable upstream UNAVAILABLE (it may retry
            // elsewhere), a slow one DEADLINE_EXCEEDED.
            Err(answer) if grpc && !render::is_grpc(Fields::Map(answer.headers())) => {
                let message = answer.extensions().get::<ErrorText>().map_or("", |t| &t.0);
                grpc_failure(answer.status(), message)
            }
            Err(answer) => closing(answer, version),
        }
    }

    /// Sends an admitted request on and relays the answer.
    async fn forward(
        &self,
        mut req: Request<RequestBody>,
        peer: SocketAddr,
        admitted: Admitted,
        call: Call,
    ) -> Result<Response<ProxyBody>, Response<ProxyBody>> {
        let client_h2 = req.version() == Version::HTTP_2;
        // RFC 9110 §7.8: an HTTP/1.0 request's `Upgrade` is ignored. Joined,
        // its client got a 101 and at once a closed connection.
        let upgrade = req.version() == Version::HTTP_11 && wants_upgrade(fields(&req));
        let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
        let host = admitted.host.as_deref();
        // A request our own HTTP/1.1 client carries has its fields written
        // straight from the client's, not rebuilt in a map first.
        let write = !upgrade && req.body().is_end_stream() && self.pool.sends_own(call.needs_h2);
        // A head's lines are written out as they are; a field to drop, or
        // hyper's client, takes a map.
        if !write || !admitted.respelled.is_empty() {
            crate::serve::into_map(&mut req);
        }
        for name in &admitted.respelled {
            req.headers_mut().remove(name);
        }
        let outgoing = match self.upstream_request(req, peer, host, upgrade, write) {
            Ok(r) => r,
            Err(status) => return Err(plain(status, "request target cannot be forwarded")),
        };
        let (response, waited) = self.exchange(outgoing, call).await?;
        // The RateLimit fields the answer gets, in place of any the
        // upstream sent: a WebSocket handshake's `101` too.
        let mut ratelimit = match self.options.ratelimit_headers {
            true => render::admission_values(&admitted.decision),
            false => None,
        };
        if response.status() == StatusCode::SWITCHING_PROTOCOLS {
            return Ok(switch_protocols(client_upgrade, response, ratelimit, waited));
        }
        let (mut parts, mut body) = response.into_parts();
        // Our own client's answers come with their fields as they came,
        // relayed as written; hyper's in their map.
        let relayed = match body.take_fields() {
            Some(fields) => match relay_written(&fields, parts.status, &mut parts.headers, ratelimit.is_some()) {
                Some((relayed, mut written)) => {
                    if let Some((policy, state)) = ratelimit.take() {
                        written.push(render::RATELIMIT_POLICY.as_str().as_bytes(), policy.as_bytes());
                        written.push(render::RATELIMIT.as_str().as_bytes(), state.as_bytes());
                    }
                    if let Err(written) = body.carry(written) {
                        written.before(&mut parts.headers);
                    }
                    relayed
                }
                // A name repeated apart (`Set-Cookie`, another,
                // `Set-Cookie`): a map writes its values together, so it
                // takes the map's way.
                None => {
                    parts.headers = fields.to_map();
                    relay_map(&mut parts.headers, parts.status)
                }
            },
            None => relay_map(&mut parts.headers, parts.status),
        };
        if relayed.forbid_reuse {
            body.forbid_reuse();
        }
        if relayed.coding == Some(Coding::Other) {
            // A transfer coding other than chunked alone (`gzip, chunked`,
            // `identity`) cannot be passed on as sent: de-chunked, a gzip
            // body would reach the client unmarked; `identity` is read to
            // the connection's close however long that takes. NGINX
            // answers 502 ("upstream sent unknown Transfer-Encoding"). The
            // connection is closed, even after an answer with no body (a
            // HEAD's, a 204): where its next answer begins is not known.
            metrics::get().upstream("error", waited);
            if let Some(failures) = upstream_failed(|| "sent a transfer coding other than chunked".into()) {
                tracing::warn!(upstream = %self.options.upstream.authority(), failures, "upstream sent a transfer coding other than chunked");
            }
            body.discard();
            return Err(plain(StatusCode::BAD_GATEWAY, "upstream unavailable"));
        }
        metrics::get().upstream(status_class(parts.status), waited);
        // The client talks to us, not to the upstream: an HTTP/1.0 upstream
        // would otherwise make hyper answer "HTTP/1.0" and close the client's
        // keep-alive connection after every response (NGINX answers 1.1).
        parts.version = http::Version::HTTP_11;
        if let Some(pair) = ratelimit {
            render::insert_ratelimit(&mut parts.headers, pair);
        }
        if client_h2 {
            // HTTP/2's default frame size.
            body.in_pieces(16 * 1024);
        }
        Ok(Response::from_parts(parts, Either::Left(body)))
    }

    /// The decision for a request, when it admits it; otherwise the answer
    /// (a refusal, or 400 for a request no rule can be matched against).
    async fn decide(&self, req: &Request<RequestBody>, peer: SocketAddr) -> Result<Admitted, Response<ProxyBody>> {
        let bad_request = |e: &dyn std::fmt::Display| {
            metrics::get().request(Surface::Proxy, metrics::Answer::BadRequest);
            plain(StatusCode::BAD_REQUEST, &e.to_string())
        };
        let client_ip = self.options.trusted.client_ip(peer.ip(), fields(req));
        let host = match crate::limits::request_host(req.version(), req.uri(), fields(req)) {
            Ok(host) => host.map(str::to_owned),
            Err(e) => return Err(bad_request(&e)),
        };
        // The path as sent: the limits refuse an ambiguous one before any
        // normalising could hide what made it so (`/a%2F/../b`).
        let tls = req.extensions().get::<crate::tls::ClientTls>();
        let info = RequestInfo {
            method: req.method(),
            path: req.uri().path(),
            query: req.uri().query(),
            host: host.as_deref(),
            headers: fields(req),
            client_ip,
            client_cert: tls.and_then(|t| t.subject.as_deref()),
        };
        // The catalog guard is let go at the end of this block, before the
        // decision awaits.
        let (hits, respelled) = {
            let catalog = self.catalog.load();
            (catalog.http_hits(&info), catalog.respelled_headers(fields(req)))
        };
        let hits = match hits {
            Ok(hits) => hits,
            Err(e) => return Err(bad_request(&e)),
        };
        let decision = self.limiter.decide(&hits).await;
        metrics::get().request(Surface::Proxy, decision.verdict.into());
        if !decision.verdict.admits() {
            if render::is_grpc(fields(req)) {
                return Err(render::grpc_refusal(&decision).map(|b| Either::Right(WholeBody::new(b))));
            }
            return Err(refusal(&decision));
        }
        Ok(Admitted {
            decision,
            host,
            respelled,
        })
    }

    /// Sends the request upstream and waits for the response headers: 400
    /// when the client's body fails, 502 when the upstream does, 504 when
    /// it does not answer in time.
    /// The answer comes with how long it was waited for: its class is told
    /// in `/metrics` by the caller, once the answer is known to be relayed
    /// (one with a transfer coding it cannot relay is a 502, an `error`).
    async fn exchange(
        &self,
        outgoing: Outgoing,
        call: Call,
    ) -> Result<(Response<UpstreamBody>, Duration), Response<ProxyBody>> {
        let Outgoing {
            request: upstream_req,
            body_sent,
            fields,
        } = outgoing;
        let Call { caller_bounds, needs_h2 } = call;
        let sent = Instant::now();
        // The wait for the answer starts once the request has been sent
        // whole: a long upload is the client's time, not the upstream's
        // (a stalled one is cut by the body timeout instead).
        let timeout = self.options.upstream_timeout;
        // Our own client times a written request's wait itself, on its
        // connection's kept timer (its body is none: sent whole at once).
        let times_itself = fields.is_some();
        let mut body_sent = body_sent;
        // What the body told, if the wait below took it.
        let body_told = std::sync::OnceLock::new();
        let answer = {
            let waited = async {
                if caller_bounds || times_itself {
                    // The caller's own deadline ends the wait (in `handle`),
                    // or the send times itself.
                    return std::future::pending().await;
                }
                // The upstream side must keep taking the body: a connection
                // that never comes up (a dropped SYN, a TLS handshake never
                // answered) or an upstream that stops reading would hold a
                // request with a body forever, its answer's wait never
                // begun. Nothing asked of the body for the body timeout,
                // while not waiting on the client, ends it (NGINX's
                // `proxy_connect_timeout` and `proxy_send_timeout`).
                // A body-less request's is known at once: no timer for it.
                let told = match body_sent.finished_now() {
                    Some(told) => told,
                    None => {
                        let limit = self.options.body_timeout;
                        loop {
                            let wait = match body_sent.unasked_for() {
                                Some(unasked) if unasked >= limit => return Waited::NotTaken(limit),
                                Some(unasked) => limit.saturating_sub(unasked),
                                // The client's turn: its body's own timer.
                                None => limit,
                            };
                            if let Ok(told) = tokio::time::timeout(wait, body_sent.finished()).await {
                                break told;
                            }
                        }
                    }
                };
                if let Some(whole) = told {
                    let _ = body_told.set(whole);
                }
                tokio::time::sleep(timeout).await;
                Waited::NoAnswer
            };
            // Not boxed: the send keeps its rare, large steps (connecting,
            // HTTP/2) in boxes of their own, so its future is ~1.3 KB; boxed
            // here it was 8.5 KB, copied whole into the box on every request
            // (BENCHMARKS.md §36, §40).
            // Both pinned where they are made: `select!` takes its futures
            // by value, and moved into it they were copied once more.
            let send = std::pin::pin!(async {
                match fields {
                    Some(fields) => {
                        let timeout = (!caller_bounds).then_some(timeout);
                        self.pool.send_written(upstream_req, fields, sent, timeout).await
                    }
                    None => self.pool.send(upstream_req, needs_h2).await,
                }
            });
            let waited = std::pin::pin!(waited);
            tokio::select! {
                answer = send => Ok(answer),
                waited = waited => Err(waited),
            }
        };
        let waited = sent.elapsed();
        // Each way out counts its class, but for a client's failed body:
        // the upstream is not at fault, and a client could raise its error
        // rate at will.
        let count = |class| metrics::get().upstream(class, waited);
        match answer {
            // hyper bounds an HTTP/1 head; an HTTP/2 one, up to the header
            // list size the connection advertises, is bounded here.
            Ok(Ok(r))
                if r.version() == Version::HTTP_2
                    && crate::serve::head_bytes(r.headers()) > crate::upstream::MAX_RESPONSE_HEAD =>
            {
                count("error");
                if let Some(failures) = upstream_failed(|| "sent a response head larger than 64 KB".into()) {
                    tracing::warn!(upstream = %self.options.upstream.authority(), bytes = crate::serve::head_bytes(r.headers()), failures, "upstream sent a response head larger than 64 KB");
                }
                Err(plain(StatusCode::BAD_GATEWAY, "upstream unavailable"))
            }
            Ok(Ok(r)) => {
                if let Some(t) = UPSTREAM_FAILURES.answered() {
                    tracing::warn!(upstream = %self.options.upstream.authority(), failures = t.failures(), last_error = %t.cause, "upstream answering again; requests failed since the last line");
                }
                Ok((r, waited))
            }
            Ok(Err(SendError::NoAnswer)) => {
                count("timeout");
                if let Some(failures) = upstream_failed(|| "timed out".into()) {
                    tracing::warn!(upstream = %self.options.upstream.authority(), timeout = ?timeout, failures, "upstream timed out");
                }
                Err(plain(StatusCode::GATEWAY_TIMEOUT, "upstream timed out"))
            }
            Ok(Err(e)) if e.is_client_body() || body_told.get().copied().or_else(|| body_sent.try_finished()) == Some(false) => {
                // Over HTTP/2 hyper reports the stream it reset for it.
                tracing::info!(error = %e, "client request body failed (stalled past --upstream-body-timeout, or reset); the exchange was ended");
                Err(plain(StatusCode::BAD_REQUEST, "the request body could not be read"))
            }
            Ok(Err(e)) => {
                count("error");
                if let Some(failures) = upstream_failed(|| e.to_string()) {
                    tracing::warn!(error = %e, failures, "upstream failed");
                }
                Err(plain(StatusCode::BAD_GATEWAY, "upstream unavailable"))
            }
            Err(Waited::NotTaken(limit)) => {
                count("timeout");
                metrics::get().body_stalled(true);
                if let Some(failures) = upstream_failed(|| "took none of the request body in time".into()) {
                    tracing::warn!(upstream = %self.options.upstream.authority(), timeout = ?limit, failures, "upstream took none of the request body within --upstream-body-timeout (connecting, or not reading)");
                }
                Err(plain(StatusCode::GATEWAY_TIMEOUT, "upstream timed out"))
            }
            Err(Waited::NoAnswer) => {
                count("timeout");
                if let Some(failures) = upstream_failed(|| "timed out".into()) {
                    tracing::warn!(upstream = %self.options.upstream.authority(), timeout = ?timeout, failures, "upstream timed out");
                }
                Err(plain(StatusCode::GATEWAY_TIMEOUT, "upstream timed out"))
            }
        }
    }

    /// Rewrites the client's request for the upstream: origin-form URI, HTTP/1.1,
    /// no hop-by-hop headers, forwarding headers appended. With `write`,
    /// the header fields come back written out ([`Forwarding::written`])
    /// and the request's map is left empty.
    fn upstream_request(
        &self,
        req: Request<RequestBody>,
        peer: SocketAddr,
        host: Option<&str>,
        upgrade: bool,
        write: bool,
    ) -> Result<Outgoing, StatusCode> {
        let (mut parts, body) = req.into_parts();
        let tls = parts.extensions.get::<crate::tls::ClientTls>().is_some();
        // The upstream sees the normalised path the limits were matched on
        // (less the `;params` matching ignores: the upstream reads them).
        let normal = crate::path::normalize(parts.uri.path());
        let path = match (&normal, parts.uri.path_and_query()) {
            // Already normal: the same bytes, shared rather than parsed
            // again. Only from an origin-form target: an absolute one's (and
            // HTTP/2's) may begin without the path (`http://a.example?x=1`,
            // a `:path` of `?x=1`, nothing before a `#`), which the rules
            // matched as `/`, and origin-form begins with `/` (RFC 9112
            // §3.2.1); shared, it went upstream as `?x=1` or as nothing.
            (Cow::Borrowed(_), Some(pq)) if parts.uri.scheme().is_none() && pq.as_str().starts_with('/') => Ok(pq.clone()),
            (_, _) => match parts.uri.query() {
                Some(q) => PathAndQuery::try_from(format!("{normal}?{q}")),
                None => PathAndQuery::try_from(normal.as_ref()),
            },
        }
        .map_err(|_| StatusCode::BAD_REQUEST)?;
        parts.uri = Uri::from(path);
        parts.version = Version::HTTP_11;
        let forwarding = Forwarding {
            peer,
            trusted: self.options.trusted.trusts(peer.ip()),
            host,
            tls,
            upstream_host: self.options.upstream.host(),
        };
        if write {
            let fields = forwarding.written(match &body {
                RequestBody::Lines(lines) => Fields::Lines(lines),
                _ => Fields::Map(&parts.headers),
            });
            parts.headers = HeaderMap::new();
            let (body, sent) = ClientBody::new(body.into_incoming(), self.options.body_timeout);
            return Ok(Outgoing {
                request: Request::from_parts(parts, body),
                body_sent: sent,
                fields: Some(fields),
            });
        }
        forwarding.rewrite(&mut parts.headers, upgrade);
        let (body, sent) = ClientBody::new(body.into_incoming(), self.options.body_timeout);
        Ok(Outgoing {
            request: Request::from_parts(parts, body),
            body_sent: sent,
            fields: None,
        })
    }
}

/// A request made ready for the upstream.
struct Outgoing {
    request: Request<ClientBody>,
    /// How much of its body has gone.
    body_sent: BodyProgress,
    /// Its header fields written out, when its map is left empty (see
    /// [`Forwarding::written`]).
    fields: Option<Vec<u8>>,
}

/// What the upstream is told of where a request came from, and how.
struct Forwarding<'a> {
    /// The client (or the proxy in front).
    peer: SocketAddr,
    /// Whether `peer`'s forwarding headers are believed.
    trusted: bool,
    /// The host the rules matched, if the request named one.
    host: Option<&'a str>,
    /// Whether the client came over TLS.
    tls: bool,
    /// `Host` for a request that named none.
    upstream_host: &'a HeaderValue,
}

impl Forwarding<'_> {
    /// Rewrites a client's `headers` for the upstream in place: no
    /// hop-by-hop fields (but `TE: trailers`), an untrusted client's claims
    /// gone, cookies joined, the forwarding fields set.
    fn rewrite(&self, headers: &mut HeaderMap, upgrade: bool) {
        let Forwarding { peer, trusted, host, tls, upstream_host } = *self;
        // `TE: trailers` says the client takes trailers: gRPC servers ask
        // for it, and tollgate passes trailers through, so it is kept.
        let trailers = headers.get_all(header::TE).iter().any(|v| says_trailers(v.as_bytes()));
        strip_hop_by_hop(headers, upgrade);
        if trailers {
            headers.insert(header::TE, HeaderValue::from_static("trailers"));
        }
        strip_claims(headers, trusted);
        join_cookies(headers);
        append_forwarded_for(headers, peer);
        if !trusted || !headers.contains_key(&X_FORWARDED_PROTO) {
            let proto = if tls { "https" } else { "http" };
            headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(proto));
        }
        let mut has_host = headers.contains_key(header::HOST);
        if let Some(host) = host.and_then(|h| HeaderValue::from_str(h).ok()) {
            if !has_host {
                headers.insert(header::HOST, host.clone());
                has_host = true;
            }
            // Always the host the rules matched, a trusted proxy's own
            // too: a front that passes a client's X-Forwarded-Host on
            // unchanged (NGINX and Envoy by default) would otherwise hand
            // the upstream a host (Rails routes by it) no host rule saw.
            headers.insert(X_FORWARDED_HOST, host);
        } else {
            // No host named (HTTP/1.0 without Host): no claim of one either.
            headers.remove(X_FORWARDED_HOST);
        }
        if !has_host {
            headers.insert(header::HOST, upstream_host.clone());
        }
    }

    /// The upstream request's header fields written out (`name:
    /// value\r\n`), made from the client's `headers` in one pass: the
    /// fields [`Self::rewrite`] leaves in a map, with the same
    /// values, without the map's removals and insertions, which were most
    /// of what a forwarded request's head cost (BENCHMARKS.md §57). The
    /// client's fields keep the map's order (its removals move the last
    /// field into a removed one's place); those tollgate adds come after,
    /// in the map's order.
    fn written(&self, headers: Fields<'_>) -> Vec<u8> {
        let Forwarding { peer, trusted, host, tls, upstream_host } = *self;
        // Fields a `Connection` names besides the hop-by-hop ones (rare).
        let named: Vec<HeaderName> = connection_tokens(headers)
            .filter(|t| !names_hop_by_hop(t))
            .filter_map(|t| HeaderName::from_bytes(t).ok())
            .collect();
        let host = host.and_then(|h| HeaderValue::from_str(h).ok());
        let proto: &[u8] = if tls { b"https" } else { b"http" };
        // Room for the fields and those added (a head's lines: its length,
        // not counted again).
        let room = match headers {
            Fields::Lines(lines) => lines.head().len(),
            Fields::Map(_) => headers.head_bytes(),
        };
        let mut out = Vec::with_capacity(room.saturating_add(160));
        let mut line = |name: &[u8], value: &[u8]| {
            out.extend_from_slice(name);
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        };
        let (mut trailers, mut has_host, mut has_for, mut has_proto, mut has_forwarded_host) = (false, false, false, false, false);
        // Whether a trusted proxy's `Forwarded` goes on, told at its first
        // line: its lines come one after another, and one naming a host
        // takes them all.
        let mut forwarded_passes = true;
        // The name whose values are being passed: both ways of holding
        // fields give a name's values one after another.
        let mut current: Option<&[u8]> = None;
        for (name, value) in headers.iter() {
            let first = current != Some(name);
            current = Some(name);
            if Relay::of(name).is_hop_by_hop() || named.iter().any(|n| n.as_str().as_bytes() == name) {
                // `TE: trailers` says the client takes trailers: kept.
                trailers |= name == b"te" && says_trailers(value);
                continue;
            }
            if goes(name, trusted) {
                continue;
            }
            match name {
                b"forwarded" => {
                    if first {
                        forwarded_passes = !headers.get_all(&header::FORWARDED).any(forwarded_names_host);
                    }
                    if forwarded_passes {
                        line(name, value);
                    }
                }
                b"cookie" if first => {
                    let lines = headers.get_all(&header::COOKIE).count();
                    match lines {
                        1 => line(b"cookie", value),
                        _ => line(b"cookie", &crate::limits::http::cookie_line(headers)),
                    }
                }
                b"cookie" => {}
                b"host" => {
                    has_host = true;
                    line(b"host", value);
                }
                b"x-forwarded-for" => {
                    if first {
                        has_for = true;
                        line(b"x-forwarded-for", &forwarded_for(headers, peer));
                    }
                }
                b"x-forwarded-proto" if !trusted => {
                    if first {
                        has_proto = true;
                        line(b"x-forwarded-proto", proto);
                    }
                }
                b"x-forwarded-proto" => {
                    has_proto = true;
                    line(b"x-forwarded-proto", value);
                }
                b"x-forwarded-host" => {
                    // Always the host the rules matched; none named, none
                    // claimed.
                    if first && let Some(host) = &host {
                        has_forwarded_host = true;
                        line(b"x-forwarded-host", host.as_bytes());
                    }
                }
                _ => line(name, value),
            }
        }
        if trailers {
            line(b"te", b"trailers");
        }
        // None passed on (none sent, or `Connection` named it): the peer.
        if !has_for {
            line(b"x-forwarded-for", crate::client_ip::ip_text(peer.ip().to_canonical()).as_bytes());
        }
        if !has_proto {
            line(b"x-forwarded-proto", proto);
        }
        if let Some(host) = &host {
            if !has_host {
                line(b"host", host.as_bytes());
                has_host = true;
            }
            if !has_forwarded_host {
                line(b"x-forwarded-host", host.as_bytes());
            }
        }
        if !has_host {
            line(b"host", upstream_host.as_bytes());
        }
        out
    }
}

fn status_class(status: StatusCode) -> &'static str {
    match status.as_u16() {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        500..=599 => "5xx",
        // 600-999: passed on as sent (as NGINX does), but no server error
        // an alert on 5xx should fire for.
        _ => "other",
    }
}

/// Whether the request's transfer codings are `chunked` alone.
fn only_chunked(headers: &HeaderMap) -> bool {
    only_token(headers, &header::TRANSFER_ENCODING, b"chunked")
}

/// Whether the comma-separated tokens of every `name` header are `token`
/// alone (in any case).
fn only_token(headers: &HeaderMap, name: &HeaderName, token: &[u8]) -> bool {
    only_token_in(headers.get_all(name).iter().map(HeaderValue::as_bytes), token)
}

/// [`only_token`] of the values of one field, as bytes.
fn only_token_in<'a>(values: impl Iterator<Item = &'a [u8]>, token: &[u8]) -> bool {
    let mut tokens = values.flat_map(|v| v.split(|b| *b == b',')).map(<[u8]>::trim_ascii);
    tokens.next().is_some_and(|t| t.eq_ignore_ascii_case(token)) && tokens.next().is_none()
}

/// Only a WebSocket handshake is joined end to end. Any other upgrade (h2c
/// above all) would open a tunnel whose requests tollgate never sees, so
/// its headers are dropped and the request goes up as plain HTTP/1.1, as
/// NGINX and Envoy do by default.
fn wants_upgrade(headers: Fields<'_>) -> bool {
    only_token_in(headers.get_all(&header::UPGRADE), b"websocket")
        && connection_tokens(headers).any(|t| t.eq_ignore_ascii_case(b"upgrade"))
}

/// The comma-separated tokens of every `Connection` header, as bytes so that
/// a non-ASCII value cannot make us fail.
fn connection_tokens(headers: Fields<'_>) -> impl Iterator<Item = &[u8]> {
    headers.get_all(&header::CONNECTION).flat_map(tokens)
}

/// The comma-separated tokens of one `Connection` value.
fn tokens(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value.split(|b| *b == b',').map(<[u8]>::trim_ascii).filter(|t| !t.is_empty())
}

/// Whether a `Connection` token names a hop-by-hop header (in any case),
/// which is removed whether named or not. False for a token too long to
/// look at on the stack: it is then removed by its name like any other.
fn names_hop_by_hop(token: &[u8]) -> bool {
    let mut lower = [0u8; 32];
    let Some(lower) = lower.get_mut(..token.len()) else {
        return false;
    };
    lower.copy_from_slice(token);
    lower.make_ascii_lowercase();
    std::str::from_utf8(lower).is_ok_and(is_hop_by_hop)
}

/// A message's `Transfer-Encoding`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Coding {
    /// `chunked` alone.
    Chunked,
    /// Anything else (`gzip, chunked`, `identity`, `chunked` twice).
    Other,
}

/// Removes hop-by-hop headers and those named by `Connection`; for an upgrade
/// the `Upgrade` header survives with `Connection: upgrade`.
/// Returns the `Transfer-Encoding` that was among them, if one was.
fn strip_hop_by_hop(headers: &mut HeaderMap, upgrade: bool) -> Option<Coding> {
    // Nearly every message has none, or a few (an answer's `Connection:
    // keep-alive`, `Keep-Alive`) with a `Connection` that names no other
    // field: found on the stack and removed, with no list built (which
    // was most of this function's cost, BENCHMARKS.md §57).
    const FEW: usize = 4;
    if upgrade {
        return strip_hop_by_hop_named(headers, upgrade);
    }
    let mut found: [Option<&HeaderName>; FEW] = [None; FEW];
    let mut count = 0usize;
    for name in headers.keys().filter(|n| is_hop_by_hop(n.as_str())) {
        match found.get_mut(count) {
            Some(slot) => *slot = Some(name),
            None => return strip_hop_by_hop_named(headers, false),
        }
        count = count.saturating_add(1);
    }
    if count == 0 {
        return None;
    }
    // `keep-alive` alone (an answer's commonest) is told without splitting.
    let names_others = headers.get_all(header::CONNECTION).iter().any(|v| {
        !v.as_bytes().eq_ignore_ascii_case(b"keep-alive")
            && v.as_bytes().split(|b| *b == b',').map(<[u8]>::trim_ascii).any(|t| !t.is_empty() && !names_hop_by_hop(t))
    });
    if names_others {
        return strip_hop_by_hop_named(headers, false);
    }
    let found: [Option<HeaderName>; FEW] = found.map(|n| n.cloned());
    let coded = found.iter().flatten().any(|n| *n == header::TRANSFER_ENCODING).then(|| match only_chunked(headers) {
        true => Coding::Chunked,
        false => Coding::Other,
    });
    for name in found.into_iter().flatten() {
        headers.remove(name);
    }
    coded
}

/// [`strip_hop_by_hop`] for any message: more hop-by-hop fields than a
/// few, a `Connection` that names other fields, or an upgrade.
fn strip_hop_by_hop_named(headers: &mut HeaderMap, upgrade: bool) -> Option<Coding> {
    // One pass over the few names present is cheaper than a hashed removal
    // per hop-by-hop name, and most messages carry one at most.
    let mut doomed: Vec<HeaderName> = headers.keys().filter(|n| is_hop_by_hop(n.as_str())).cloned().collect();
    if doomed.contains(&header::CONNECTION) {
        // `Connection: keep-alive` names a header already doomed: no name
        // is made for it (most responses and many requests say so).
        let named = connection_tokens(Fields::Map(headers))
            .filter(|t| !names_hop_by_hop(t))
            .filter_map(|t| HeaderName::from_bytes(t).ok());
        doomed.extend(named);
    }
    let coded = doomed.contains(&header::TRANSFER_ENCODING).then(|| match only_chunked(headers) {
        true => Coding::Chunked,
        false => Coding::Other,
    });
    for name in doomed {
        if !(upgrade && name == header::UPGRADE) {
            headers.remove(name);
        }
    }
    if upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    coded
}

/// What relaying an answer's fields found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Relayed {
    /// The `Transfer-Encoding` among the hop-by-hop fields, if one was.
    coding: Option<Coding>,
    /// A 204 that says it has a body (a transfer coding, a length other
    /// than 0; RFC 9112 §6.1, RFC 9110 §8.6 forbid both) is passed on
    /// without one, as both clients read it, but its connection is not
    /// used again: the bytes it announced may yet come.
    forbid_reuse: bool,
}

/// Leaves in an upstream answer's map the fields the client gets: no
/// hop-by-hop ones, and one plain `Content-Length` where one belongs.
fn relay_map(headers: &mut HeaderMap, status: StatusCode) -> Relayed {
    let forbid_reuse = status == StatusCode::NO_CONTENT
        && (headers.contains_key(header::TRANSFER_ENCODING)
            || headers.get(header::CONTENT_LENGTH).is_some_and(|l| l.as_bytes() != b"0"));
    let coding = strip_hop_by_hop(headers, false);
    // A 204 has no Content-Length (RFC 9110 §8.6), as NGINX sends it:
    // hyper would pass an upstream's on, for a client that reads it to
    // wait for bytes that never come, or take the next response's. Nor
    // has a body the upstream framed with Transfer-Encoding: that
    // overrides a Content-Length beside it, which a proxy must remove
    // (RFC 9112 §6.3); passed on beside the re-framed body, it cut the
    // client's read short (a complete-looking truncated answer) or
    // left hyper refusing the response (an empty reply).
    if coding.is_some() || status == StatusCode::NO_CONTENT {
        headers.remove(header::CONTENT_LENGTH);
    } else {
        single_length(headers);
    }
    Relayed { coding, forbid_reuse }
}

/// What a field's name makes of it when an answer is relayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Relay {
    /// `Connection`: dropped, and the fields it names.
    Connection,
    /// `Transfer-Encoding`: dropped, and read for the coding.
    Coding,
    /// `Content-Length`: made one plain number (see `single_length`).
    Length,
    /// Another hop-by-hop field ([`is_hop_by_hop`]): dropped.
    Hop,
    /// `Date`.
    Date,
    /// `RateLimit` or `RateLimit-Policy`: replaced by tollgate's own when
    /// it adds them.
    RateLimit,
    /// Relayed as it came.
    Other,
}

impl Relay {
    /// Whether the field is hop-by-hop by its name alone.
    fn is_hop_by_hop(self) -> bool {
        matches!(self, Relay::Connection | Relay::Coding | Relay::Hop)
    }

    /// The kind of the field `name` (in any case): one length test, then
    /// one or two compares, where comparing `HeaderName`s took seven per
    /// header looked at (BENCHMARKS.md §46).
    fn of(name: &[u8]) -> Relay {
        let is = |wanted: &[u8]| name.eq_ignore_ascii_case(wanted);
        match name.len() {
            2 if is(b"te") => Relay::Hop,
            4 if is(b"date") => Relay::Date,
            9 if is(b"ratelimit") => Relay::RateLimit,
            16 if is(b"ratelimit-policy") => Relay::RateLimit,
            5 if is(b"proxy") => Relay::Hop,
            7 if is(b"upgrade") || is(b"trailer") => Relay::Hop,
            10 if is(b"connection") => Relay::Connection,
            10 if is(b"keep-alive") => Relay::Hop,
            14 if is(b"content-length") => Relay::Length,
            14 if is(b"http2-settings") => Relay::Hop,
            17 if is(b"transfer-encoding") => Relay::Coding,
            _ if name.get(..6).is_some_and(|p| p.eq_ignore_ascii_case(b"proxy-")) => Relay::Hop,
            _ => Relay::Other,
        }
    }
}

/// [`relay_map`] for fields as they came: the ones the client gets are
/// written out in the order they came (names in lower case, as from a
/// map), but `Content-Length`, which goes into `headers` for the server to
/// frame the body with. The same fields go as [`relay_map`] leaves, in the
/// order a map of them writes; the tests hold the two to each other.
/// `None` for fields a map would write in another order: a name repeated
/// with another between, whose values a map writes together. With
/// `replacing`, the upstream's `RateLimit` and `RateLimit-Policy` go too:
/// tollgate writes its own.
fn relay_written(
    fields: &UpstreamFields,
    status: StatusCode,
    headers: &mut HeaderMap,
    replacing: bool,
) -> Option<(Relayed, WrittenFields)> {
    let mut coded = false;
    let mut first_length: Option<&[u8]> = None;
    // Whether a `Connection` names a field that is not hop-by-hop anyway.
    let mut names_others = false;
    // Each field's kind, told once for both passes (the first 32; a
    // later one is told again).
    let mut kinds = [Relay::Other; 32];
    for (at, (name, value)) in fields.iter().enumerate() {
        let relay = Relay::of(name);
        if let Some(kind) = kinds.get_mut(at) {
            *kind = relay;
        }
        match relay {
            Relay::Connection => names_others |= tokens(value).any(|t| !Relay::of(t).is_hop_by_hop()),
            Relay::Coding => coded = true,
            Relay::Length => first_length = first_length.or(Some(value)),
            _ => {}
        }
    }
    let no_content = status == StatusCode::NO_CONTENT;
    let forbid_reuse = no_content && (coded || first_length.is_some_and(|l| l != b"0"));
    let coding = coded.then(|| {
        let codings = fields.iter().filter(|(n, _)| Relay::of(n) == Relay::Coding).map(|(_, v)| v);
        match only_token_in(codings, b"chunked") {
            true => Coding::Chunked,
            false => Coding::Other,
        }
    });
    let named = |name: &[u8]| {
        fields
            .iter()
            .filter(|(n, _)| Relay::of(n) == Relay::Connection)
            .any(|(_, v)| tokens(v).any(|t| t.eq_ignore_ascii_case(name)))
    };
    let mut written = WrittenFields {
        // The fields are no longer than the head; room for tollgate's
        // RateLimit lines besides.
        lines: Vec::with_capacity(fields.head_len().saturating_add(128)),
        has_date: false,
    };
    let mut length = crate::upstream::Length::Absent;
    let mut lengths = 0usize;
    let mut plain = None;
    // The names written, to find one repeated with another between.
    let mut names: [&[u8]; 16] = [b""; 16];
    let mut count = 0usize;
    for (at, (name, value)) in fields.iter().enumerate() {
        let relay = kinds.get(at).copied().unwrap_or_else(|| Relay::of(name));
        if relay.is_hop_by_hop() || replacing && relay == Relay::RateLimit || names_others && named(name) {
            continue;
        }
        if relay == Relay::Length {
            length = length.and(value);
            lengths = lengths.saturating_add(1);
            plain = Some(value);
            continue;
        }
        let last = count.checked_sub(1).and_then(|i| names.get(i));
        if !last.is_some_and(|l| l.eq_ignore_ascii_case(name)) {
            let seen = names.get(..count)?;
            if seen.iter().any(|n| n.eq_ignore_ascii_case(name)) {
                return None;
            }
            // A 17th name: the map's way too (`None`), rather than a
            // longer search for repeats.
            *names.get_mut(count)? = name;
            count = count.saturating_add(1);
        }
        written.has_date |= relay == Relay::Date;
        written.push(name, value);
    }
    // As `single_length` makes it (see `relay_map` for why none at all).
    if !(coding.is_some() || no_content) {
        let value = match (lengths, plain) {
            (1, Some(v)) if plain_length(v) => fields.share(v).and_then(|v| HeaderValue::from_maybe_shared(v).ok()),
            _ => match length {
                crate::upstream::Length::Is(n) => Some(HeaderValue::from(n)),
                _ => None,
            },
        };
        if let Some(value) = value {
            headers.insert(header::CONTENT_LENGTH, value);
        }
    }
    Some((Relayed { coding, forbid_reuse }, written))
}

/// Makes the upstream's `Content-Length` one plain number: repeated equal
/// values (`5, 5`, or two lines) become one, `0005` becomes `5`, and
/// values that disagree or are not numbers (`-1`, `+5`, `abc`, past 2^64)
/// are dropped, as NGINX drops them. A body's length was checked by the
/// client that read it (a bad one is a 502); these are on answers with no
/// body (HEAD, 304), which clients failed on (curl: "Invalid
/// Content-Length"; over HTTP/2 a PROTOCOL_ERROR), and hyper's server
/// would not write at all with a second line (an empty reply).
fn single_length(headers: &mut HeaderMap) {
    let mut values = headers.get_all(header::CONTENT_LENGTH).iter();
    let Some(first) = values.next() else { return };
    if values.next().is_none() && plain_length(first.as_bytes()) {
        return;
    }
    match crate::upstream::Length::of(headers.get_all(header::CONTENT_LENGTH)) {
        crate::upstream::Length::Is(n) => {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
        }
        _ => {
            headers.remove(header::CONTENT_LENGTH);
        }
    }
}

/// Nearly every length: digits without a leading zero, short of 2^64.
fn plain_length(v: &[u8]) -> bool {
    (1..=19).contains(&v.len()) && v.iter().all(u8::is_ascii_digit) && (v.len() == 1 || v.first() != Some(&b'0'))
}

/// Removes the claims a client's fields make that do not go upstream
/// (see [`goes`]), and a `Forwarded` that names a host, whoever sent it.
fn strip_claims(headers: &mut HeaderMap, trusted: bool) {
    let doomed: Vec<HeaderName> = headers.keys().filter(|name| goes(name.as_str().as_bytes(), trusted)).cloned().collect();
    for name in doomed {
        headers.remove(name);
    }
    if headers.get_all(header::FORWARDED).iter().any(|v| forwarded_names_host(v.as_bytes())) {
        headers.remove(header::FORWARDED);
    }
}

/// Whether field `name` goes before the request does upstream: a claim
/// of a host or path to serve, from anyone ([`is_target_claim`]), or of
/// who the client is and how it came, from a peer not trusted
/// ([`is_claim`]).
fn goes(name: &[u8], trusted: bool) -> bool {
    is_target_claim(name) || (!trusted && is_claim(name))
}

/// Whether field `name` names a host or path for the upstream to serve in
/// place of the request's own, and so goes whoever sent it: the rules
/// matched the request's own, and a trusted front that passes a client's
/// fields on unchanged (NGINX and Envoy do by default) would otherwise
/// hand the upstream one no rule saw, as `X-Forwarded-Host` would (which
/// tollgate writes itself). IIS-style frameworks serve `X-Original-URL`
/// and `X-Rewrite-URL`; `X-Host`, `X-Original-Host`, `X-Forwarded-Server`
/// and `X-HTTP-Host-Override` are read as the host by others; PHP and Rack
/// read `X-Forwarded_Host` as `X-Forwarded-Host`. Any spelling with `_`
/// for `-` counts.
fn is_target_claim(name: &[u8]) -> bool {
    // Every one begins with `x` (names come in lower case): most fields
    // are told by their first byte.
    if name.first() != Some(&b'x') {
        return false;
    }
    const TARGETS: [&[u8]; 6] =
        [b"x-original-url", b"x-rewrite-url", b"x-host", b"x-original-host", b"x-forwarded-server", b"x-http-host-override"];
    // `_` read as `-`, without a copy: every field of every request is asked.
    let reads_as = |wanted: &[u8]| {
        wanted.len() == name.len() && wanted.iter().zip(name).all(|(w, b)| *w == if *b == b'_' { b'-' } else { *b })
    };
    TARGETS.iter().any(|t| reads_as(t)) || (name != X_FORWARDED_HOST.as_str().as_bytes() && reads_as(X_FORWARDED_HOST.as_str().as_bytes()))
}

/// Whether a `Forwarded` value (RFC 7239) names a host: Spring and Rack 3
/// serve the host it names. `host` followed by `=` anywhere counts, in a
/// quoted value or another pair's name too: the field then goes, the safe
/// side.
fn forwarded_names_host(value: &[u8]) -> bool {
    // Anywhere, not only as a pair's name: Spring, Vert.x and Reactor
    // Netty find `host="?...` with an unanchored pattern, so `xhost=` and
    // `for="_host=..."` name a host to them (the 42nd attack).
    value.windows(4).enumerate().any(|(at, word)| {
        word.eq_ignore_ascii_case(b"host")
            && value.get(at.saturating_add(4)..).is_some_and(|rest| rest.trim_ascii_start().first() == Some(&b'='))
    })
}

/// Whether an untrusted client's field `name` goes: the scheme claims,
/// and any field that reads as a forwarding field once `_` is read as `-`
/// (CGI-style servers, PHP and Rack among them, put `X-Forwarded_Proto`
/// and `X-Forwarded-Proto` in one variable; NGINX drops such names by
/// default). `X-Forwarded_Host` goes from anyone ([`is_target_claim`]).
fn is_claim(name: &[u8]) -> bool {
    let forwarding = |name: &[u8]| {
        is_scheme_claim(name) || name == X_FORWARDED_FOR.as_str().as_bytes() || name == X_FORWARDED_PROTO.as_str().as_bytes()
    };
    let dashed = || name.iter().map(|b| if *b == b'_' { b'-' } else { *b }).collect::<Vec<u8>>();
    is_scheme_claim(name) || (name.contains(&b'_') && forwarding(&dashed()))
}

/// Joins several `Cookie` lines into one with `; `: an HTTP/2 client sends
/// each cookie as a field of its own (browsers do), and RFC 9113 §8.2.3
/// has them joined so before they go on over HTTP/1.1. Passed on as lines,
/// WSGI servers joined them with `,` and Django and Flask read one broken
/// cookie. NGINX joins them too.
fn join_cookies(headers: &mut HeaderMap) {
    let mut lines = headers.get_all(header::COOKIE).iter();
    if lines.next().is_none() || lines.next().is_none() {
        return;
    }
    if let Ok(value) = HeaderValue::from_bytes(&crate::limits::http::cookie_line(Fields::Map(headers))) {
        headers.insert(header::COOKIE, value);
    }
}

/// Appends the peer to `X-Forwarded-For`, folding earlier lines into one.
fn append_forwarded_for(headers: &mut HeaderMap, peer: SocketAddr) {
    if let Ok(v) = HeaderValue::from_maybe_shared(Bytes::from(forwarded_for(Fields::Map(headers), peer))) {
        headers.insert(X_FORWARDED_FOR, v);
    }
}

/// `X-Forwarded-For` as the upstream gets it: the client's lines folded
/// into one, `, ` and the peer after them, or the peer alone.
fn forwarded_for(headers: Fields<'_>, peer: SocketAddr) -> Vec<u8> {
    let ip = crate::client_ip::ip_text(peer.ip().to_canonical());
    let mut value = Vec::new();
    for v in headers.get_all(&X_FORWARDED_FOR) {
        value.extend_from_slice(v);
        value.extend_from_slice(b", ");
    }
    value.extend_from_slice(ip.as_bytes());
    value
}

/// Whether a `TE` value names `trailers` (in any case): the client takes
/// trailers, which gRPC servers ask for and tollgate passes on.
fn says_trailers(value: &[u8]) -> bool {
    value.split(|b| *b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(b"trailers"))
}

/// An admitted request: its decision (for the RateLimit headers), host,
/// and the fields the upstream is not to see (see
/// [`crate::limits::Catalog::respelled_headers`]).
struct Admitted {
    decision: Decision,
    host: Option<String>,
    respelled: Vec<HeaderName>,
}

/// Relays an upstream's `101`: the two upgraded connections are joined end
/// to end. A protocol switch nobody asked for (or to another protocol than
/// the WebSocket the client asked for) cannot be relayed: 502.
/// `ratelimit`: tollgate's RateLimit fields, which replace the upstream's.
fn switch_protocols(
    client_upgrade: Option<OnUpgrade>,
    mut response: Response<UpstreamBody>,
    ratelimit: Option<(HeaderValue, HeaderValue)>,
    waited: Duration,
) -> Response<ProxyBody> {
    let Some(client_upgrade) = client_upgrade.filter(|_| wants_upgrade(Fields::Map(response.headers()))) else {
        metrics::get().upstream("error", waited);
        tracing::warn!("upstream switched protocols unasked");
        return plain(StatusCode::BAD_GATEWAY, "upstream switched protocols unasked");
    };
    metrics::get().upstream("1xx", waited);
    let upstream_upgrade = hyper::upgrade::on(&mut response);
    tokio::spawn(async move {
        match tokio::try_join!(client_upgrade, upstream_upgrade) {
            Ok((client, upstream)) => {
                let _ = tokio::io::copy_bidirectional(&mut TokioIo::new(client), &mut TokioIo::new(upstream)).await;
            }
            Err(e) => tracing::debug!(error = %e, "upgrade failed"),
        }
    });
    let (mut parts, _) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers, true);
    if let Some(pair) = ratelimit {
        render::insert_ratelimit(&mut parts.headers, pair);
    }
    Response::from_parts(parts, Either::Right(WholeBody::new(Bytes::new())))
}

/// A refused request's answer ([`render::refusal`]), its fields written
/// out rather than in a map.
fn refusal(decision: &Decision) -> Response<ProxyBody> {
    let (fields, body) = render::refusal_written(decision);
    let mut response = Response::new(Either::Right(WholeBody::with_fields(body, fields)));
    *response.status_mut() = decision.status();
    response
}

/// tollgate's own failure, answered to a gRPC call: 400 as INVALID_ARGUMENT,
/// 502 as UNAVAILABLE (14), 504 as DEADLINE_EXCEEDED (4), as Envoy maps them.
fn grpc_failure(status: StatusCode, message: &str) -> Response<ProxyBody> {
    let code = match status {
        StatusCode::GATEWAY_TIMEOUT => tonic::Code::DeadlineExceeded,
        StatusCode::BAD_GATEWAY | StatusCode::SERVICE_UNAVAILABLE => tonic::Code::Unavailable,
        s if s.is_client_error() => tonic::Code::InvalidArgument,
        _ => tonic::Code::Unknown,
    };
    grpc_status(code, message)
}

fn grpc_status(code: tonic::Code, message: &str) -> Response<ProxyBody> {
    render::grpc_error(code, message).map(|b| Either::Right(WholeBody::new(b)))
}

/// How a gRPC call is forwarded (both false for other requests).
#[derive(Clone, Copy)]
struct Call {
    /// The caller's grpc-timeout bounds the wait for the upstream.
    caller_bounds: bool,
    /// It goes upstream over HTTP/2 whatever the upstream's scheme.
    needs_h2: bool,
}

/// Why tollgate answered a request itself, kept beside the answer so that
/// a gRPC call can be told the same in `grpc-message`.
#[derive(Clone)]
struct ErrorText(Box<str>);

/// tollgate's own answer to an HTTP/1 request it could not read (400) or
/// take (501), made to close the connection, as NGINX closes it: what the
/// client sends next may not be read as it meant it (README: malformed
/// requests get 400 and the connection closes).
fn closing(mut answer: Response<ProxyBody>, version: Version) -> Response<ProxyBody> {
    if version <= Version::HTTP_11 && matches!(answer.status(), StatusCode::BAD_REQUEST | StatusCode::NOT_IMPLEMENTED) {
        answer.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        // hyper adds `keep-alive` beside `close` for an HTTP/1.0 client
        // that asked for it, unless the answer is HTTP/1.0 too (the 42nd
        // attack): said so, it writes `close` alone.
        if version == Version::HTTP_10 {
            *answer.version_mut() = Version::HTTP_10;
        }
    }
    answer
}

fn plain(status: StatusCode, message: &str) -> Response<ProxyBody> {
    let mut response = render::error(status, message).map(|b| Either::Right(WholeBody::new(b)));
    response.extensions_mut().insert(ErrorText(message.into()));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_chunked_coding_alone_is_passed_on() {
        let te = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(header::TRANSFER_ENCODING, HeaderValue::from_str(v).unwrap());
            }
            only_chunked(&h)
        };
        assert!(te(&["chunked"]));
        assert!(te(&["Chunked "]));
        assert!(!te(&["gzip, chunked"]));
        assert!(!te(&["gzip", "chunked"]));
        assert!(!te(&["chunked, chunked"]));
        assert!(!te(&["identity"]));
        assert!(!te(&[""]));
    }

    fn headers(pairs: &[(&str, &[u8])]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_bytes(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn hop_by_hop_headers_go_and_named_ones_too() {
        let mut h = headers(&[
            ("connection", b"keep-alive, x-secret"),
            ("connection", b"\xffweird"),
            ("keep-alive", b"timeout=5"),
            ("x-secret", b"1"),
            ("te", b"trailers"),
            ("set-cookie", b"a=1"),
            ("set-cookie", b"b=2"),
            ("proxy-foo", b"1"),
            ("proxy", b"http://evil:1"),
            ("proxy-authorization", b"Basic eDp5"),
            ("proxyish", b"kept"),
        ]);
        strip_hop_by_hop(&mut h, false);
        assert!(!h.contains_key("x-secret") && !h.contains_key("connection") && !h.contains_key("te"));
        assert!(!h.contains_key("proxy-foo") && !h.contains_key("proxy") && !h.contains_key("proxy-authorization"));
        assert!(h.contains_key("proxyish"));
        assert_eq!(h.get_all("set-cookie").iter().count(), 2);
    }

    #[test]
    fn connection_tokens_name_headers_in_any_case() {
        let long = "proxy-".to_string() + &"x".repeat(40);
        let mut h = headers(&[
            ("connection", format!("Keep-Alive, CLOSE, X-Gone, {}", long.to_uppercase()).as_bytes()),
            ("keep-alive", b"timeout=5"),
            ("close", b"1"),
            ("x-gone", b"1"),
            (&long, b"1"),
            ("x-kept", b"1"),
        ]);
        strip_hop_by_hop(&mut h, false);
        let left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left, ["x-kept"]);
        for name in ["connection", "keep-alive", "te", "transfer-encoding", "upgrade", "trailer", "http2-settings"] {
            assert!(is_hop_by_hop(name) && names_hop_by_hop(name.to_uppercase().as_bytes()), "{name}");
        }
        for name in ["proxy", "proxy-", "proxy-connection"] {
            assert!(is_hop_by_hop(name), "{name}");
        }
        for name in ["proxyish", "prox", "tes", "connections", "x-connection", ""] {
            assert!(!is_hop_by_hop(name) && !names_hop_by_hop(name.as_bytes()), "{name}");
        }
        assert!(!names_hop_by_hop(long.as_bytes()), "too long to look at: removed by name instead");
    }

    #[test]
    fn upgrades_keep_their_headers() {
        let mut h = headers(&[("connection", b"Upgrade"), ("upgrade", b"websocket")]);
        assert!(wants_upgrade(crate::fields::Fields::Map(&h)));
        strip_hop_by_hop(&mut h, true);
        assert_eq!(h["upgrade"], "websocket");
        assert_eq!(h["connection"], "upgrade");
    }

    #[test]
    fn only_websocket_upgrades_pass() {
        for (upgrade, passes) in [
            (&b"websocket"[..], true),
            (b"WebSocket", true),
            (b"h2c", false),
            (b"websocket, h2c", false),
            (b"h2c, websocket", false),
            (b"foo", false),
        ] {
            let mut h = headers(&[
                ("connection", b"Upgrade, HTTP2-Settings"),
                ("upgrade", upgrade),
                ("http2-settings", b"AAMAAABkAARAAAAAAAIAAAAA"),
            ]);
            assert_eq!(wants_upgrade(crate::fields::Fields::Map(&h)), passes, "{upgrade:?}");
            let upgrade = wants_upgrade(crate::fields::Fields::Map(&h));
            strip_hop_by_hop(&mut h, upgrade);
            assert!(!h.contains_key("http2-settings"));
            assert_eq!(h.contains_key("upgrade"), passes, "{upgrade:?}");
        }
        // HTTP2-Settings goes even when Connection does not name it.
        let mut h = headers(&[("http2-settings", b"AAMAAABkAARAAAAAAAIAAAAA")]);
        strip_hop_by_hop(&mut h, false);
        assert!(h.is_empty());
    }

    #[test]
    fn an_untrusted_clients_scheme_claims_go_in_every_spelling() {
        let mut h = headers(&[
            ("forwarded", b"for=1.2.3.4;proto=https"),
            ("x-forwarded-ssl", b"on"),
            ("front-end-https", b"on"),
            ("x-forwarded_proto", b"https"),
            ("x_forwarded_for", b"1.2.3.4"),
            ("x_real_ip", b"1.2.3.4"),
            ("x-real-ip", b"1.2.3.4"),
            ("x-api_key", b"kept"),
            ("x-forwarded-proto", b"https"),
            ("client-ip", b"1.2.3.4"),
            ("client_ip", b"1.2.3.4"),
            ("true-client-ip", b"1.2.3.4"),
            ("x-client-ip", b"1.2.3.4"),
            ("x-cluster-client-ip", b"1.2.3.4"),
            ("x-original-url", b"/admin"),
            ("x-rewrite-url", b"/admin"),
        ]);
        strip_claims(&mut h, false);
        let mut left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        left.sort_unstable();
        // X-Forwarded-Proto itself is overwritten by the caller, not here.
        assert_eq!(left, ["x-api_key", "x-forwarded-proto"]);
    }

    #[test]
    fn a_host_or_path_for_the_upstream_goes_from_any_peer_in_every_spelling() {
        for name in [
            "x-original-url", "x_original_url", "x-rewrite-url", "x-host", "x_host", "x-original-host", "x-forwarded-server",
            "x-http-host-override", "x-forwarded_host", "x_forwarded_host", "x_forwarded-host",
        ] {
            assert!(is_target_claim(name.as_bytes()), "{name}");
        }
        // tollgate writes X-Forwarded-Host itself; the rest are no target.
        for name in ["x-forwarded-host", "host", "x-forwarded-for", "forwarded", "x-hostname", "x-hos", "x-api_key"] {
            assert!(!is_target_claim(name.as_bytes()), "{name}");
        }
        for value in [
            "host=a",
            "for=1.2.3.4;host=a",
            "for=1.2.3.4, HOST = a",
            "proto=https;Host=\"a\"",
            "for=\"x;host=y\"",
            // Found by unanchored patterns (Spring's, Vert.x's).
            "for=1;xhost=evil",
            "for=1;x-host=evil",
            "for=1;by=host=evil",
            "for=\"_host=evil\"",
            "for=\"a host=evil\"",
        ] {
            assert!(forwarded_names_host(value.as_bytes()), "{value}");
        }
        for value in ["for=1.2.3.4;proto=https", "by=hostess", "for=\"_hidden\"", "", "host", "hostname=a"] {
            assert!(!forwarded_names_host(value.as_bytes()), "{value}");
        }
        let mut h = headers(&[("forwarded", b"for=1.2.3.4"), ("forwarded", b"for=5.6.7.8;host=a"), ("x-a", b"1")]);
        strip_claims(&mut h, true);
        assert!(!h.contains_key("forwarded"), "one line naming a host takes them all");
        let mut h = headers(&[("forwarded", b"for=1.2.3.4;proto=https")]);
        strip_claims(&mut h, true);
        assert!(h.contains_key("forwarded"));
    }

    #[test]
    fn forwarded_for_is_one_line() {
        let mut h = headers(&[("x-forwarded-for", b"1.1.1.1"), ("x-forwarded-for", b"2.2.2.2")]);
        append_forwarded_for(&mut h, "[::ffff:10.0.0.1]:5000".parse().unwrap());
        assert_eq!(h.get_all("x-forwarded-for").iter().count(), 1);
        assert_eq!(h["x-forwarded-for"], "1.1.1.1, 2.2.2.2, 10.0.0.1");
    }

    #[test]
    fn upstream_urls() {
        assert!(Upstream::parse("http://127.0.0.1:9000", None).is_ok());
        assert!(Upstream::parse("http://127.0.0.1:9000/", None).is_ok());
        assert!(matches!(
            Upstream::parse("ftp://x:1", None),
            Err(crate::upstream::UpstreamError::Scheme(_))
        ));
        let https = Upstream::parse("https://api.example", None).unwrap();
        assert_eq!(https.port(), 443);
        assert!(https.tls().is_some());
        assert_eq!(Upstream::parse("http://api.example", None).unwrap().port(), 80);
        let missing = Upstream::parse("https://x:1", Some(std::path::Path::new("/nonexistent/ca.pem")));
        assert!(matches!(missing, Err(crate::upstream::UpstreamError::Tls(_))));
        assert!(Upstream::parse("http://x:1/api", None).is_err());
        assert!(Upstream::parse("127.0.0.1:9000", None).is_err());
        // The 41st attack: these started, and every request was a 502.
        for bad in [
            "http://127.0.0.1,x:9000",
            "http://u:p@127.0.0.1:9000",
            "http://127.0.0.1:9000?x=1",
            "http://a..b:1",
            // The 42nd attack: these started, going to port 80 or a fragment dropped.
            "http://127.0.0.1:",
            "http://127.0.0.1:99999",
            "http://127.0.0.1:0",
            "http://127.0.0.1:9000#f",
            "h2c://u@127.0.0.1:9000",
        ] {
            assert!(matches!(Upstream::parse(bad, None), Err(crate::upstream::UpstreamError::Malformed(..))), "{bad}");
        }
        assert!(Upstream::parse("http://[::1]:9000", None).is_ok());
        assert!(Upstream::parse("h2c://localhost:9000", None).is_ok());
    }

    proptest::proptest! {
        /// The few-fields path removes what the general one removes, leaves
        /// the rest in the same order, and reads the same coding.
        #[test]
        fn hop_by_hop_fields_go_as_the_general_path_takes_them(
            fields in proptest::collection::vec(
                (
                    proptest::sample::select(vec![
                        "connection", "keep-alive", "te", "transfer-encoding", "upgrade", "trailer", "proxy",
                        "proxy-authorization", "http2-settings", "x-a", "close", "date", "set-cookie", "x-secret",
                    ]),
                    proptest::sample::select(vec![
                        "keep-alive", "close", "Keep-Alive, Upgrade", "chunked", "gzip, chunked", "x-a", "x-secret, te",
                        "TE", "", "1",
                    ]),
                ),
                0..9,
            ),
            upgrade in proptest::bool::ANY,
        ) {
            let pairs: Vec<(&str, &[u8])> = fields.iter().map(|(n, v)| (*n, v.as_bytes())).collect();
            let (mut fast, mut general) = (headers(&pairs), headers(&pairs));
            let coded = (strip_hop_by_hop(&mut fast, upgrade), strip_hop_by_hop_named(&mut general, upgrade));
            proptest::prop_assert_eq!(coded.0, coded.1);
            let order = |h: &HeaderMap| h.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect::<Vec<_>>();
            proptest::prop_assert_eq!(order(&fast), order(&general));
        }
    }

    proptest::proptest! {
        /// An answer's fields relayed as written are the fields its map
        /// keeps (value for value, in each name's order), with the same
        /// coding and reuse found, both as our own server writes them and
        /// as hyper gets them back in its map.
        #[test]
        fn fields_relayed_as_written_are_the_ones_the_map_keeps(
            fields in proptest::collection::vec(
                (
                    proptest::sample::select(vec![
                        "Connection", "connection", "Keep-Alive", "TE", "Transfer-Encoding", "transfer-encoding", "Upgrade",
                        "Trailer", "Proxy", "proxy-authorization", "Proxy-Connection", "Proxyx", "HTTP2-Settings", "Content-Length",
                        "content-length", "Date", "X-A", "x-a", "Set-Cookie", "X-Secret", "Content-Type", "RateLimit",
                        "ratelimit-policy",
                        "x-a-field-name-longer-than-thirty-two-bytes",
                    ]),
                    proptest::sample::select(vec![
                        "keep-alive", "close", "Keep-Alive, Upgrade", "chunked", "Chunked", "gzip, chunked", "chunked,",
                        "x-a", "X-Secret, te", "content-length", "Date, close", "5", "05", "5, 5", "6", "0", "-1", "",
                        "18446744073709551615", "18446744073709551616", "x-a-field-name-longer-than-thirty-two-bytes",
                        "text/plain", "caf\u{e9}", "Proxy-x-a-field-name-longer-than-thirty-two, date",
                    ]),
                ),
                0..10,
            ),
            status in proptest::sample::select(vec![200u16, 204, 304, 404]),
            replacing in proptest::bool::ANY,
            // Lines of one name before the drawn ones: past 32 fields,
            // the relay tells a field's kind again rather than keep it.
            padding in 0usize..40,
        ) {
            let mut head = format!("HTTP/1.1 {status} X\r\n").into_bytes();
            for n in 0..padding {
                head.extend_from_slice(format!("X-Pad: {n}\r\n").as_bytes());
            }
            for (name, value) in &fields {
                head.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
            }
            head.extend_from_slice(b"\r\n");
            let upstream = UpstreamFields::of_head(&head).unwrap();
            let status = StatusCode::from_u16(status).unwrap();
            let mut map = upstream.to_map();
            let by_map = relay_map(&mut map, status);
            // tollgate's own RateLimit fields, as `forward` adds them.
            let (policy, state) = (HeaderValue::from_static("\"r\";q=5;w=60"), HeaderValue::from_static("\"r\";r=4;t=60"));
            if replacing {
                render::insert_ratelimit(&mut map, (policy.clone(), state.clone()));
            }
            let mut beside = HeaderMap::new();
            let Some((by_lines, mut written)) = relay_written(&upstream, status, &mut beside, replacing) else {
                // Only for a name repeated with another between.
                let names: Vec<String> = map.keys().map(|n| n.to_string()).collect();
                let kept: Vec<String> = upstream.iter().map(|(n, _)| String::from_utf8_lossy(n).to_ascii_lowercase()).filter(|n| names.contains(n)).collect();
                let mut runs = kept.clone();
                runs.dedup();
                let mut distinct = runs.clone();
                distinct.sort();
                distinct.dedup();
                proptest::prop_assert!(runs.len() > distinct.len() || names.len() > 16, "{kept:?}");
                return Ok(());
            };
            proptest::prop_assert_eq!(by_map, by_lines);
            if replacing {
                written.push(b"ratelimit-policy", policy.as_bytes());
                written.push(b"ratelimit", state.as_bytes());
            }
            let by_name = |mut p: Vec<(String, Vec<u8>)>| {
                p.sort_by(|a, b| a.0.cmp(&b.0));
                p
            };
            let mut got = lines(&written.lines);
            got.extend(pairs(&beside));
            proptest::prop_assert_eq!(by_name(got), by_name(pairs(&map)));
            proptest::prop_assert_eq!(written.has_date, map.contains_key(header::DATE));
            // Our own server writes the lines, then the map's fields;
            // hyper the map the lines went back into: the same, in order.
            let mut ours = lines(&written.lines);
            ours.extend(pairs(&beside));
            let mut response = Response::new(Carried(Some(written)));
            *response.headers_mut() = beside;
            WrittenFields::into_map(&mut response);
            proptest::prop_assert!(response.body().0.is_none());
            proptest::prop_assert_eq!(&pairs(response.headers()), &ours);
            proptest::prop_assert_eq!(by_name(pairs(response.headers())), by_name(pairs(&map)));
        }
    }

    /// A body carrying written fields, as the proxy's does.
    struct Carried(Option<WrittenFields>);

    impl crate::serve::CarriesFields for Carried {
        fn take_written(&mut self) -> Option<WrittenFields> {
            self.0.take()
        }
    }

    /// A header list as HTTP/1.1 writes it, read back into pairs.
    fn lines(written: &[u8]) -> Vec<(String, Vec<u8>)> {
        written
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| {
                let l = l.strip_suffix(b"\r").unwrap();
                let colon = l.iter().position(|b| *b == b':').unwrap();
                (String::from_utf8(l[..colon].to_vec()).unwrap(), l[colon + 2..].to_vec())
            })
            .collect()
    }

    fn pairs(headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
        headers.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
    }

    #[test]
    fn a_plain_requests_fields_are_written_in_order_then_the_forwarding_ones() {
        let upstream_host = HeaderValue::from_static("backend:8080");
        let forwarding = Forwarding {
            peer: "10.1.2.3:5555".parse().unwrap(),
            trusted: false,
            host: Some("api.example"),
            tls: false,
            upstream_host: &upstream_host,
        };
        let h = headers(&[("host", b"api.example"), ("user-agent", b"curl/8"), ("accept", b"*/*")]);
        let written = forwarding.written(crate::fields::Fields::Map(&h));
        assert_eq!(
            String::from_utf8(written).unwrap(),
            "host: api.example\r\nuser-agent: curl/8\r\naccept: */*\r\nx-forwarded-for: 10.1.2.3\r\n\
             x-forwarded-proto: http\r\nx-forwarded-host: api.example\r\n"
        );
        let mut map = h.clone();
        forwarding.rewrite(&mut map, false);
        assert_eq!(pairs(&map), lines(&forwarding.written(crate::fields::Fields::Map(&h))), "the map's order, nothing removed");
    }

    proptest::proptest! {
        /// Fields written in one pass are the fields the map's rewrite
        /// leaves, value for value and in each name's order.
        #[test]
        fn written_fields_are_the_rewritten_maps(
            fields in proptest::collection::vec(
                (
                    proptest::sample::select(vec![
                        "host", "cookie", "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "x_forwarded_for",
                        "x-forwarded_host", "x_forwarded_proto", "x-real-ip", "forwarded", "te", "connection", "keep-alive",
                        "upgrade", "proxy-authorization", "x-a", "x-b", "user-agent", "accept", "trailer", "transfer-encoding",
                        "x-original-url", "x_host", "x-forwarded-server",
                    ]),
                    proptest::sample::select(vec![
                        "a", " b ", "trailers", "x-a", "keep-alive", "1.2.3.4", "c=1", "te, trailers", "x-b, close",
                        "host", "cookie", "x-forwarded-for", "x-forwarded-proto", "X-Forwarded-Host, x-a", "https", "",
                        "deflate,  Trailers ", "TRAILERS", "x-a-field-name-longer-than-thirty-two-bytes",
                        "for=1.2.3.4;host=api.example", "for=1.2.3.4, for=5.6.7.8;proto=https", " Host = x",
                    ]),
                ),
                0..10,
            ),
            trusted in proptest::bool::ANY,
            host in proptest::option::of(proptest::sample::select(vec!["api.example", "api.example:8443", "[::1]", "bad\u{1}host"])),
            tls in proptest::bool::ANY,
            v6 in proptest::bool::ANY,
            upper in proptest::collection::vec(proptest::bool::ANY, 10),
        ) {
            let upstream_host = HeaderValue::from_static("backend:8080");
            let peer: SocketAddr = if v6 { "[2001:db8::7]:1".parse().unwrap() } else { "[::ffff:10.0.0.9]:1".parse().unwrap() };
            let forwarding = Forwarding { peer, trusted, host, tls, upstream_host: &upstream_host };
            let pairs_in: Vec<(&str, &[u8])> = fields.iter().map(|(n, v)| (*n, v.as_bytes())).collect();
            let h = headers(&pairs_in);
            let mut map = h.clone();
            forwarding.rewrite(&mut map, false);
            let by_name = |mut p: Vec<(String, Vec<u8>)>| {
                p.sort_by(|a, b| a.0.cmp(&b.0));
                p
            };
            let written = forwarding.written(crate::fields::Fields::Map(&h));
            proptest::prop_assert_eq!(by_name(lines(&written)), by_name(pairs(&map)));
            // The same head read as lines (names in any case, values
            // trimmed as httparse reads them) is written out byte for byte
            // as its map is (which `fields::` holds to the lines).
            let spelled: Vec<(Vec<u8>, &[u8])> = fields
                .iter()
                .zip(upper.iter().cycle())
                .map(|((n, v), up)| (if *up { n.to_ascii_uppercase() } else { n.to_string() }.into_bytes(), v.as_bytes()))
                .collect();
            if let Ok(read) = crate::fields::Lines::laid_out(spelled.iter().map(|(n, v)| (&n[..], *v))) {
                let map = read.to_map();
                proptest::prop_assert_eq!(
                    forwarding.written(crate::fields::Fields::Lines(&read)),
                    forwarding.written(crate::fields::Fields::Map(&map))
                );
            }
        }
    }
}
