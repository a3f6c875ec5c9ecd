//! The worker threads: each with its own single-threaded runtime, proxy
//! listening socket (`SO_REUSEPORT`), upstream pool and Redis lane, so a
//! request never hops between threads (as NGINX workers). Each also serves
//! the gRPC connections dealt to it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::StartError;
use crate::serve::{ConnLimits, Gate, ReadsLines, accept, serve};
use crate::surfaces::envoy_rls::RlsService;
use crate::surfaces::proxy::Proxy;
use crate::surfaces::rls_wire::RlsServer;
use crate::tls::{ClientStream, TlsListener};

/// What one worker thread serves.
pub(super) struct Worker {
    /// The proxy's listening socket for this thread, and the proxy.
    pub proxy: Option<(std::net::TcpListener, Proxy)>,
    /// TLS on the proxy listener.
    pub tls: Option<TlsListener>,
    /// TLS on the gRPC connections.
    pub grpc_tls: Option<TlsListener>,
    /// gRPC connections dealt to this thread, and the RLS answering them.
    pub grpc: Option<(mpsc::UnboundedReceiver<std::net::TcpStream>, RlsService)>,
    /// Limits on client connections.
    pub limits: ConnLimits,
    /// The bound on proxy connections, shared by every worker.
    pub gate: Gate,
    /// Turns true when the server stops.
    pub stop: watch::Receiver<bool>,
}

impl Worker {
    /// Serves until `stop` turns true and everything has drained.
    pub fn run(self) {
        let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "cannot start a proxy thread's runtime");
                return;
            }
        };
        let Worker {
            proxy,
            tls,
            grpc_tls,
            grpc,
            limits,
            gate,
            stop,
        } = self;
        runtime.block_on(async move {
            // Ends with the runtime.
            tokio::spawn(crate::heap::return_free_pages());
            let http = async {
                let Some((listener, proxy)) = proxy else {
                    return;
                };
                let listener = match TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot use the proxy listener");
                        return;
                    }
                };
                let proxy = Arc::new(proxy);
                // The proxy reads fields through `serve::fields`: our own
                // server hands it a GET's head lines, no map built.
                let app = ReadsLines(move |req, peer| proxy.clone().handle(req, peer));
                serve(listener, limits, gate, tls, stop.clone(), app).await
            };
            match grpc {
                Some((incoming, rls)) => {
                    tokio::join!(
                        http,
                        serve_grpc(incoming, grpc_tls, rls, stop.clone(), limits.header_read_timeout)
                    );
                }
                None => http.await,
            }
        });
    }
}

/// `n` listening sockets on one address (SO_REUSEPORT): the kernel spreads
/// connections over them. With port 0 all share the port the first got.
pub(super) fn bind_shared(addr: SocketAddr, n: usize) -> Result<Vec<std::net::TcpListener>, StartError> {
    if addr.port() != 0 {
        refuse_if_taken(addr)?;
    }
    let mut addr = addr;
    let mut listeners = Vec::with_capacity(n);
    for _ in 0..n {
        let wanted = addr;
        let listener = (|| {
            let socket = if addr.is_ipv4() {
                TcpSocket::new_v4()?
            } else {
                TcpSocket::new_v6()?
            };
            socket.set_reuseaddr(true)?;
            socket.set_reuseport(true)?;
            socket.bind(addr)?;
            let listener = socket.listen(1024)?;
            addr = listener.local_addr()?;
            listener.into_std()
        })()
        .map_err(|e| StartError::Listen(wanted, e))?;
        listeners.push(listener);
    }
    if let Some(first) = listeners.first()
        && !listened_on_alone(first, &listeners)
    {
        return Err(StartError::Listen(
            addr,
            std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                "another process began to listen there at the same time: is tollgate already running?",
            ),
        ));
    }
    Ok(listeners)
}

/// Whether no other process listens on `first`'s address, as the kernel's
/// socket table (`/proc/net/tcp`, `tcp6`) tells. [`refuse_if_taken`]'s
/// probe is passed by two tollgates started at the same moment: both probe
/// before either listens. Checked after listening, the later of the two
/// sees the earlier (at the same moment, each sees the other and both
/// stop). Unreadable tables (no `/proc`) are not a reason to stop.
fn listened_on_alone(first: &std::net::TcpListener, ours: &[std::net::TcpListener]) -> bool {
    use std::os::fd::AsRawFd;
    // A socket's inode, from its descriptor's link `socket:[INODE]`.
    let inode = |l: &std::net::TcpListener| {
        let link = std::fs::read_link(format!("/proc/self/fd/{}", l.as_raw_fd())).ok()?;
        let link = link.to_str()?;
        Some(link.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
    };
    let ours: Vec<String> = ours.iter().filter_map(inode).collect();
    let Some(mine) = inode(first) else { return true };
    let table = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|t| std::fs::read_to_string(t).ok())
        .collect::<Vec<_>>()
        .join("\n");
    // Fields: sl, local address, remote address, state (0A: listening),
    // ..., the inode tenth.
    let listening: Vec<(&str, &str)> = table
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            match (fields.get(1), fields.get(3), fields.get(9)) {
                (Some(local), Some(&"0A"), Some(inode)) => Some((*local, *inode)),
                _ => None,
            }
        })
        .collect();
    let Some(&(local, _)) = listening.iter().find(|(_, inode)| *inode == mine) else {
        return true;
    };
    !listening
        .iter()
        .any(|(other, inode)| *other == local && !ours.iter().any(|o| o == inode))
}

/// Fails when another process listens on `addr`. `SO_REUSEPORT` lets a
/// second tollgate of the same user bind the port beside the first, where
/// NGINX would stop with "Address already in use": the kernel would then
/// deal connections between two processes, and on the memory store each
/// would count its share apart, every limit doubled. A socket bound without
/// it is refused while any socket listens there (`SO_REUSEADDR` only lets
/// it past the closed connections of an earlier run).
fn refuse_if_taken(addr: SocketAddr) -> Result<(), StartError> {
    let probe = if addr.is_ipv4() {
        TcpSocket::new_v4()
    } else {
        TcpSocket::new_v6()
    }
    .and_then(|socket| {
        socket.set_reuseaddr(true)?;
        socket.bind(addr)
    });
    match probe {
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(StartError::Listen(
            addr,
            std::io::Error::new(
                e.kind(),
                format!("{e} (another process listens there: is tollgate already running?)"),
            ),
        )),
        // Anything else is found again by the bind itself, and told there.
        _ => Ok(()),
    }
}

/// Accepts gRPC connections and deals them to the worker threads in turn.
/// Envoy keeps a few long-lived HTTP/2 connections to its rate limit
/// service: too few for `SO_REUSEPORT`'s hash to spread them evenly.
pub(super) async fn deal_grpc(
    listener: TcpListener,
    mut workers: Vec<mpsc::UnboundedSender<std::net::TcpStream>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut next = 0usize;
    let gate = Gate::new("grpc", None);
    while let Some((stream, _)) = accept(&listener, &gate, &mut stop).await {
        let mut stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "cannot hand a gRPC connection over");
                continue;
            }
        };
        // A thread that could not start has no receiver: skip it for good.
        while !workers.is_empty() {
            let i = next % workers.len();
            match workers[i].send(stream) {
                Ok(()) => {
                    next = next.wrapping_add(1);
                    break;
                }
                Err(mpsc::error::SendError(back)) => {
                    stream = back;
                    workers.remove(i);
                }
            }
        }
        if workers.is_empty() {
            tracing::error!("no thread left to serve gRPC");
            return;
        }
    }
}

/// The connections dealt to this thread, ready for tonic: as they are, or
/// once their TLS handshake is done (each on its own task, within
/// `handshake_within`, so a slow client holds up no other).
fn handshakes(
    incoming: mpsc::UnboundedReceiver<std::net::TcpStream>,
    tls: Option<TlsListener>,
    handshake_within: Duration,
) -> UnboundedReceiverStream<std::io::Result<ClientStream>> {
    let (ready, out) = mpsc::unbounded_channel();
    let failures = crate::metrics::get().tls_handshake_failures("grpc");
    tokio::spawn(async move {
        let mut incoming = incoming;
        while let Some(stream) = incoming.recv().await {
            let stream = match tokio::net::TcpStream::from_std(stream) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot take a gRPC connection over");
                    continue;
                }
            };
            let Some(tls) = &tls else {
                let _ = ready.send(Ok(ClientStream::Plain(stream)));
                continue;
            };
            let (acceptor, ready, failures) = (tls.acceptor().clone(), ready.clone(), failures.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(handshake_within, acceptor.accept(stream)).await {
                    Ok(Ok(session)) => {
                        let _ = ready.send(Ok(ClientStream::Tls(Box::new(session))));
                    }
                    Ok(Err(e)) => {
                        failures.inc();
                        tracing::debug!(error = %e, "gRPC TLS handshake failed");
                    }
                    Err(_) => {
                        failures.inc();
                        tracing::debug!("gRPC TLS handshake not done within the header read timeout");
                    }
                }
            });
        }
    });
    UnboundedReceiverStream::new(out)
}

/// Serves Envoy RLS and gRPC health on the connections dealt to this thread
/// until `stop` turns true.
async fn serve_grpc(
    incoming: mpsc::UnboundedReceiver<std::net::TcpStream>,
    tls: Option<TlsListener>,
    rls: RlsService,
    mut stop: watch::Receiver<bool>,
    ping_every: Duration,
) {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<RlsServer>().await;
    // The service name envoyproxy/ratelimit reports health under.
    reporter
        .set_service_status("ratelimit", tonic_health::ServingStatus::Serving)
        .await;
    let incoming = handshakes(incoming, tls, ping_every);
    // A peer that stops answering HTTP/2 PINGs (a slow-loris that sent a
    // preface and never a whole request) is closed; Envoy answers them.
    let result = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(ping_every))
        .http2_keepalive_timeout(Some(ping_every))
        .add_service(health)
        .add_service(RlsServer::new(rls))
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await;
    if let Err(e) = result {
        tracing::error!(error = %e, "gRPC server failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener on `addr` with `SO_REUSEPORT`, as a second tollgate's.
    fn shared(addr: SocketAddr) -> std::net::TcpListener {
        let socket = TcpSocket::new_v4().unwrap();
        socket.set_reuseaddr(true).unwrap();
        socket.set_reuseport(true).unwrap();
        socket.bind(addr).unwrap();
        socket.listen(16).unwrap().into_std().unwrap()
    }

    #[tokio::test]
    async fn a_listener_beside_ours_on_our_address_is_seen() {
        let ours = bind_shared("127.0.0.1:0".parse().unwrap(), 2).unwrap();
        let addr = ours[0].local_addr().unwrap();
        assert!(listened_on_alone(&ours[0], &ours), "our own sockets are ours");
        let other = shared(addr);
        assert!(!listened_on_alone(&ours[0], &ours), "another socket listens on {addr}");
        // Closed, it leaves ours alone again.
        drop(other);
        assert!(listened_on_alone(&ours[0], &ours));
    }
}
