//! A running tollgate: what the settings describe, started and stopped.
//!
//! [`Server::start`] loads the limits (and watches them), opens the counter
//! store, binds every listener and starts the workers ([`workers`]: one
//! thread per core, each serving the proxy and the gRPC connections dealt to
//! it); [`Server::stop`] drains them. [`run`] does both around a shutdown
//! signal, as `main` does; tests start a server in-process the same way.

mod workers;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

use crate::admin::{Admin, AdminAccess};
use crate::client_ip::{BadCidr, TrustedProxies};
use crate::limiter::{Limiter, MemoryStore, RedisMode, RedisStore, Store, StoreError, SystemClock};
use crate::reload::{CatalogError, LiveFiles, WatchGuard};
use crate::serve::{ConnLimits, serve};
use crate::settings::{Listen, RedisModeArg, Settings};
use crate::surfaces::decision_http::DecisionHttp;
use crate::surfaces::envoy_rls::RlsService;
use crate::surfaces::proxy::{Proxy, ProxyOptions};
use crate::upstream::{Upstream, UpstreamError};

/// Why tollgate cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// `--upstream` is not usable.
    #[error("{0}")]
    Upstream(#[from] UpstreamError),
    /// Neither a proxy nor a decision listener is on.
    #[error("nothing to serve: give --upstream, or leave a decision listener (--grpc-listen, --check-listen) on")]
    NothingToServe,
    /// `--trusted-proxies` holds something that is not a CIDR.
    #[error("--trusted-proxies: {0}")]
    TrustedProxies(#[from] BadCidr),
    /// A limits file is invalid, or two clash.
    #[error("{0}")]
    Limits(#[from] CatalogError),
    /// The limits files cannot be watched.
    #[error("cannot watch the limits files: {0}")]
    Watch(#[from] notify::Error),
    /// `--redis` is not usable.
    #[error("--redis: {0}")]
    Redis(#[from] StoreError),
    /// A listener cannot be bound.
    #[error("cannot listen on {0}: {1}")]
    Listen(SocketAddr, std::io::Error),
    /// A worker thread cannot be started.
    #[error("cannot start a proxy thread: {0}")]
    Thread(std::io::Error),
}

/// Where a started server listens (port 0 in the settings is resolved here).
#[derive(Debug, Clone, Copy)]
pub struct Addresses {
    /// The proxy, when there is an upstream.
    pub proxy: Option<SocketAddr>,
    /// The admin listener.
    pub admin: SocketAddr,
    /// The Envoy RLS gRPC listener.
    pub grpc: Option<SocketAddr>,
    /// The HTTP decision listener (ext_authz, auth_request).
    pub check: Option<SocketAddr>,
    /// Health probes on `--listen` when there is no proxy.
    pub health: Option<SocketAddr>,
}

/// A started tollgate.
pub struct Server {
    addresses: Addresses,
    files: Arc<LiveFiles>,
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    grace: std::time::Duration,
    _watch: Option<Vec<WatchGuard>>,
}

/// Starts tollgate, serves until `shutdown` resolves, then drains.
pub async fn run(settings: Settings, shutdown: impl Future<Output = ()>) -> Result<(), StartError> {
    let server = Server::start(settings).await?;
    shutdown.await;
    server.stop().await;
    Ok(())
}

impl Server {
    /// Loads, binds and starts everything `settings` describe. Must be
    /// called inside a multi-threaded tokio runtime.
    pub async fn start(settings: Settings) -> Result<Server, StartError> {
        let upstream = settings.upstream.as_deref().map(Upstream::parse).transpose()?;
        // Beside a proxy, whoever reaches the RLS can charge any caller's
        // counters with descriptors of their choosing: loopback only.
        let grpc_listen = settings.grpc_listen.unwrap_or_else(|| {
            let ip = if upstream.is_some() {
                [127, 0, 0, 1]
            } else {
                [0, 0, 0, 0]
            };
            Listen(Some(SocketAddr::from((ip, 8081))))
        });
        let check_listen = settings.check_listen.and_then(|l| l.0);
        if upstream.is_none() && grpc_listen.0.is_none() && check_listen.is_none() {
            return Err(StartError::NothingToServe);
        }
        let trusted = TrustedProxies::parse(&settings.trusted_proxies)?;
        let files = Arc::new(LiveFiles::load(&settings.config, settings.merge_domain_config)?);
        for f in files.files().iter() {
            let limits = f.active().load();
            let status = f.status();
            tracing::info!(file = %status.file, domain = %limits.domain, format = ?limits.format, rules = limits.rules.len(), version = %status.version, "limits loaded");
        }
        let watch_guard = match settings.watch_config {
            true => Some(files.watch()?),
            false => None,
        };
        let catalog = files.catalog();
        let limiter = Arc::new(Limiter::new(open_store(&settings)?, settings.redis_timeout));
        // Cached denials were exact for the old limits only.
        let forget = limiter.clone();
        files.on_change(move || forget.forget_denials());

        let threads = match settings.proxy_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        // A pure rate limit service has no proxy: its --listen port answers
        // health probes only, where envoyproxy/ratelimit's do.
        let (proxy_listeners, health_listener) = match upstream {
            Some(_) => (workers::bind_shared(settings.listen, threads)?, None),
            None => (Vec::new(), Some(bind(settings.listen).await?)),
        };
        let admin_listener = bind(settings.admin_listen).await?;
        let grpc_listener = match grpc_listen.0 {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };
        let check_listener = match check_listen {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };
        let local = |l: &Option<TcpListener>| l.as_ref().and_then(|l| l.local_addr().ok());
        let addresses = Addresses {
            proxy: proxy_listeners.first().and_then(|l| l.local_addr().ok()),
            admin: admin_listener
                .local_addr()
                .map_err(|e| StartError::Listen(settings.admin_listen, e))?,
            grpc: local(&grpc_listener),
            check: local(&check_listener),
            health: local(&health_listener),
        };
        let shown = |a: Option<SocketAddr>| a.map_or("off".to_string(), |a| a.to_string());
        tracing::info!(
            proxy = %shown(addresses.proxy),
            admin = %addresses.admin,
            grpc = %shown(addresses.grpc),
            health = %shown(addresses.health),
            check = %shown(addresses.check),
            "listening"
        );

        let conn_limits = ConnLimits {
            header_read_timeout: settings.header_read_timeout,
            shutdown_grace: settings.shutdown_timeout,
            ..ConnLimits::default()
        };
        let (stop, stop_rx) = watch::channel(false);
        let options = upstream.map(|upstream| ProxyOptions {
            upstream,
            upstream_timeout: settings.upstream_timeout,
            body_timeout: settings.upstream_body_timeout,
            trusted: trusted.clone(),
            ratelimit_headers: settings.ratelimit_headers,
        });
        // Threads serve the proxy listener (when there is one) and the gRPC
        // connections dealt to them.
        let mut proxy_listeners = proxy_listeners.into_iter();
        let mut worker_threads = Vec::with_capacity(threads);
        let mut grpc_workers = Vec::new();
        for i in 0..threads {
            let proxy = match (proxy_listeners.next(), &options) {
                (Some(listener), Some(options)) => {
                    Some((listener, Proxy::new(limiter.clone(), catalog.clone(), options.clone())))
                }
                _ => None,
            };
            let grpc = grpc_listener.is_some().then(|| {
                let (conns, incoming) = mpsc::unbounded_channel();
                grpc_workers.push(conns);
                let rls = RlsService::new(limiter.clone(), catalog.clone())
                    .with_dynamic_metadata(settings.rls_dynamic_metadata)
                    .with_shadow_mode(settings.rls_shadow_mode)
                    .with_quota_mode(settings.rls_quota_mode)
                    .with_headers(settings.rls_headers);
                (incoming, rls)
            });
            if proxy.is_none() && grpc.is_none() {
                break;
            }
            let worker = workers::Worker {
                proxy,
                grpc,
                limits: conn_limits,
                stop: stop_rx.clone(),
            };
            let thread = std::thread::Builder::new()
                .name(format!("proxy-{i}"))
                .spawn(move || worker.run())
                .map_err(StartError::Thread)?;
            worker_threads.push(thread);
        }

        if !settings.admin_listen.ip().is_loopback() && settings.admin_token.is_none() {
            tracing::warn!(admin = %settings.admin_listen, "admin listener is reachable beyond loopback without --admin-token; /config and /metrics are open to anyone who can reach it");
        }
        let access = AdminAccess {
            token: settings.admin_token.clone(),
            hosts: settings.admin_hosts.clone(),
        };
        let admin = Arc::new(Admin::new(limiter.clone(), files.clone(), access));
        let mut tasks = vec![tokio::spawn(serve(
            admin_listener,
            conn_limits,
            stop_rx.clone(),
            move |req, peer| {
                let admin = admin.clone();
                async move { admin.handle(req, peer).await }
            },
        ))];
        if let Some(listener) = check_listener {
            let check = Arc::new(DecisionHttp::new(limiter.clone(), catalog.clone(), trusted));
            // Whatever NGINX or Envoy accepted from a client and passes on
            // must be read here: a 431 would turn into "the check failed",
            // which the proxy in front may answer by letting the request through.
            let check_limits = ConnLimits {
                max_headers: 1024,
                max_header_bytes: 256 * 1024,
                ..conn_limits
            };
            tasks.push(tokio::spawn(serve(
                listener,
                check_limits,
                stop_rx.clone(),
                move |req, peer| {
                    let check = check.clone();
                    async move { check.handle(req, peer).await }
                },
            )));
        }
        if let Some(listener) = health_listener {
            tasks.push(tokio::spawn(serve(
                listener,
                conn_limits,
                stop_rx.clone(),
                Admin::health_only,
            )));
        }
        if let Some(listener) = grpc_listener {
            tasks.push(tokio::spawn(workers::deal_grpc(listener, grpc_workers, stop_rx)));
        }
        Ok(Server {
            addresses,
            files,
            stop,
            tasks,
            threads: worker_threads,
            grace: settings.shutdown_timeout,
            _watch: watch_guard,
        })
    }

    /// Where the server listens.
    pub fn addresses(&self) -> Addresses {
        self.addresses
    }

    /// Reloads every limits file and rescans every directory (SIGHUP).
    pub async fn reload(&self, cause: &'static str) {
        let files = self.files.clone();
        let _ = tokio::task::spawn_blocking(move || files.reload_all(cause)).await;
    }

    /// Stops accepting, lets requests in flight finish (within the
    /// shutdown grace), and returns once every listener and thread is done.
    pub async fn stop(self) {
        tracing::info!(grace = ?self.grace, "shutting down: no new connections, finishing requests in flight");
        let _ = self.stop.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
        let threads = self.threads;
        let _ = tokio::task::spawn_blocking(move || {
            for thread in threads {
                let _ = thread.join();
            }
        })
        .await;
        tracing::info!("stopped");
    }
}

/// The counter store the settings ask for: Redis when given, else memory.
fn open_store(settings: &Settings) -> Result<Store, StartError> {
    if settings.redis.is_empty() {
        tracing::info!(
            max_counters = settings.max_counters,
            "counters in memory (single instance; pass --redis to share them)"
        );
        let store = MemoryStore::new(Arc::new(SystemClock::default())).with_max_counters(settings.max_counters);
        return Ok(Store::Memory(store));
    }
    let mode = match settings.redis_mode {
        RedisModeArg::Standalone => RedisMode::Standalone,
        RedisModeArg::Cluster => RedisMode::Cluster,
        RedisModeArg::Sentinel => RedisMode::Sentinel {
            master: settings.redis_master.clone(),
        },
    };
    let store = RedisStore::connect(&settings.redis, &mode, None)?;
    tracing::info!(servers = store.server(), mode = ?mode, "counters in redis");
    Ok(Store::Redis(store))
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr).await.map_err(|e| StartError::Listen(addr, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// One HTTP/1.1 request on a fresh connection; the response's status.
    async fn status_of(addr: SocketAddr, path: &str) -> u16 {
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
        conn.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        conn.read_to_string(&mut response).await.unwrap();
        response.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0)
    }

    /// An upstream answering every request 200, until dropped.
    async fn upstream() -> (SocketAddr, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = conn.read(&mut buf).await;
                    let _ = conn
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                        .await;
                });
            }
        });
        (addr, task)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_server_started_in_process_limits_and_stops() {
        let dir = tempfile::tempdir().unwrap();
        let limits = dir.path().join("limits.yaml");
        std::fs::write(
            &limits,
            "domain: d\nrules:\n  - name: all\n    limits: [{requests: 1, per: 1h}]\n",
        )
        .unwrap();
        let (up, _upstream) = upstream().await;
        let settings = Settings::try_parse_from([
            "tollgate",
            "--config",
            limits.to_str().unwrap(),
            "--upstream",
            &format!("http://{up}"),
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--grpc-listen",
            "off",
            "--proxy-threads",
            "2",
            "--shutdown-timeout",
            "1s",
        ])
        .unwrap();
        let server = Server::start(settings).await.unwrap();
        let addresses = server.addresses();
        let proxy = addresses.proxy.unwrap();
        assert_ne!(proxy.port(), 0, "port 0 is resolved to the bound port");
        assert!(addresses.grpc.is_none() && addresses.check.is_none() && addresses.health.is_none());
        assert_eq!(status_of(proxy, "/a").await, 200);
        assert_eq!(status_of(proxy, "/a").await, 429, "one request an hour");
        assert_eq!(status_of(addresses.admin, "/healthz").await, 200);
        server.stop().await;
        assert!(
            tokio::net::TcpStream::connect(proxy).await.is_err(),
            "a stopped server no longer listens"
        );
    }

    #[tokio::test]
    async fn settings_that_serve_nothing_are_refused() {
        let settings = Settings::try_parse_from(["tollgate", "--config", "x.yaml", "--grpc-listen", "off"]).unwrap();
        let err = Server::start(settings).await.err().unwrap();
        assert!(matches!(err, StartError::NothingToServe), "{err}");
    }
}
