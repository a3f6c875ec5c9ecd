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
use crate::limiter::{Limiter, MemoryStore, RedisMode, RedisStore, SentinelAuth, Store, StoreError, SystemClock};
use crate::reload::{CatalogError, LiveFiles, WatchGuard};
use crate::serve::{ConnLimits, Gate, serve};
use crate::settings::{ClientAuthArg, Listen, RedisModeArg, Settings};
use crate::surfaces::decision_http::DecisionHttp;
use crate::surfaces::envoy_rls::RlsService;
use crate::surfaces::proxy::{Proxy, ProxyOptions};
use crate::tls::{ClientAuth, LiveCert, TlsListener};
use crate::upstream::{Upstream, UpstreamError};

/// Most connections the admin listener serves at once; more wait.
const ADMIN_CONNECTIONS: usize = 128;
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
    /// The listeners' certificate, key or client CA cannot be used.
    #[error("--tls-cert/--tls-key/--tls-client-ca: {0}")]
    Tls(#[from] crate::tls::TlsError),
    /// `--admin-token` is one no client could send.
    #[error("--admin-token (TOLLGATE_ADMIN_TOKEN) {0}")]
    AdminToken(&'static str),
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
    /// The listeners' certificate, read again on SIGHUP.
    tls_cert: Option<Arc<LiveCert>>,
    /// Told at the stop of the store failures its log has not told yet.
    limiter: Arc<Limiter>,
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
        // Its clock is the page's uptime: started with the server.
        crate::activity::get();
        if let Some(problem) = settings.admin_token.as_deref().and_then(crate::admin::token_problem) {
            return Err(StartError::AdminToken(problem));
        }
        let upstream = settings
            .upstream
            .as_deref()
            .map(|url| Upstream::parse(url, settings.upstream_ca.as_deref()))
            .transpose()?;
        let tls = Tls::load(&settings)?;
        if settings.upstream_ca.is_some() && upstream.as_ref().is_none_or(|u| u.tls().is_none()) {
            tracing::warn!("--upstream-ca is given but --upstream is not https://: it is not used");
        }
        if settings.check_tls && settings.check_listen.and_then(|l| l.0).is_none() {
            tracing::warn!("--check-tls is given but no --check-listen: it is not used");
        }
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
            tracing::info!(file = %status.file, domain = %limits.domain, format = ?limits.format, rules = limits.rules.len(), index_ms = %crate::reload::millis(limits.index.built_in()), version = %status.version, "limits loaded");
        }
        let watch_guard = match settings.watch_config {
            true => Some(files.watch()?),
            false => None,
        };
        let limiter = Arc::new(Limiter::new(open_store(&settings)?, settings.redis_timeout));
        // Cached denials were exact for the old limits only.
        let forget = limiter.clone();
        files.on_change(move || forget.forget_denials());

        let threads = match settings.proxy_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let listeners = Listeners::bind(&settings, upstream.is_some(), grpc_listen.0, check_listen, threads).await?;
        let addresses = listeners.addresses(settings.admin_listen)?;
        let (stop, stop_rx) = watch::channel(false);
        let parts = Parts {
            limiter: limiter.clone(),
            catalog: files.catalog(),
            files: files.clone(),
            trusted,
            conn_limits: ConnLimits {
                header_read_timeout: settings.header_read_timeout,
                shutdown_grace: settings.shutdown_timeout,
                keepalive_timeout: settings.keepalive_timeout,
                send_timeout: settings.send_timeout,
                ..ConnLimits::default()
            },
            proxy_gate: Gate::new("proxy", crate::serve::max_connections(settings.max_connections)),
            stop: stop_rx,
        };
        let options = upstream.map(|upstream| ProxyOptions {
            upstream,
            upstream_timeout: settings.upstream_timeout,
            body_timeout: settings.upstream_body_timeout,
            upstream_keepalive: settings.upstream_keepalive,
            upstream_keepalive_timeout: settings.upstream_keepalive_timeout,
            trusted: parts.trusted.clone(),
            ratelimit_headers: settings.ratelimit_headers,
        });
        let Listeners {
            proxy,
            admin,
            grpc,
            check,
            health,
        } = listeners;
        let (threads, grpc_workers) = parts.start_workers(&settings, proxy, options, grpc.is_some(), threads, &tls)?;
        let tasks = parts.serve_listeners(&settings, admin, check, health, grpc.map(|l| (l, grpc_workers)), &tls);
        Ok(Server {
            addresses,
            files,
            stop,
            tasks,
            threads,
            grace: settings.shutdown_timeout,
            _watch: watch_guard,
            tls_cert: tls.cert.clone(),
            limiter,
        })
    }

    /// Where the server listens.
    pub fn addresses(&self) -> Addresses {
        self.addresses
    }

    /// Reloads every limits file and rescans every directory, and reads
    /// the listeners' certificate again (SIGHUP). The future owns what it
    /// needs, so the caller can spawn it and go on listening for signals:
    /// a reload stuck reading a file (a hung network mount) must not keep
    /// SIGTERM from being heard.
    pub fn reload(&self, cause: &'static str) -> impl Future<Output = ()> + Send + 'static {
        let files = self.files.clone();
        let cert = self.tls_cert.clone();
        async move {
            crate::reload::in_background(move || files.reload_all(cause)).await;
            if let Some(cert) = cert {
                let _ = tokio::task::spawn_blocking(move || cert.check(true)).await;
            }
        }
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
        // Failures of the last second of an outage are told by the next
        // answer; at a stop there is none.
        self.limiter.tell_untold_failures();
        crate::surfaces::proxy::tell_untold_failures();
        tracing::info!("stopped");
    }
}

/// TLS for the listeners, when --tls-cert is given.
struct Tls {
    cert: Option<Arc<LiveCert>>,
    /// The proxy's and check listener's: ALPN h2 and http/1.1.
    http: Option<TlsListener>,
    /// The gRPC listener's, with --grpc-tls: ALPN h2.
    grpc: Option<TlsListener>,
}

impl Tls {
    fn load(settings: &Settings) -> Result<Tls, StartError> {
        let (Some(cert), Some(key)) = (&settings.tls_cert, &settings.tls_key) else {
            return Ok(Tls {
                cert: None,
                http: None,
                grpc: None,
            });
        };
        let cert_path = cert;
        let cert = LiveCert::load(cert, key)?;
        let client_auth = match (&settings.tls_client_ca, settings.tls_client_auth) {
            (None, _) => ClientAuth::Off,
            (Some(ca), ClientAuthArg::Required) => ClientAuth::Required(ca.clone()),
            (Some(ca), ClientAuthArg::Optional) => ClientAuth::Optional(ca.clone()),
        };
        let http = TlsListener::new(cert.clone(), &client_auth, &[b"h2", b"http/1.1"])?;
        let grpc = match settings.grpc_tls {
            true => Some(TlsListener::new(cert.clone(), &client_auth, &[b"h2"])?),
            false => None,
        };
        cert.watch();
        tracing::info!(cert = %cert_path.display(), client_auth = ?client_auth, check = settings.check_tls, grpc = settings.grpc_tls, "TLS on the proxy listener");
        Ok(Tls {
            cert: Some(cert),
            http: Some(http),
            grpc,
        })
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
            auth: settings.redis_sentinel_auth.as_deref().map(SentinelAuth::parse),
        },
    };
    let store = RedisStore::connect(&settings.redis, &mode, None)?.with_deadline(settings.redis_timeout);
    tracing::info!(servers = store.server(), mode = ?mode, "counters in redis");
    tokio::spawn(store.probe());
    Ok(Store::Redis(store))
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr).await.map_err(|e| StartError::Listen(addr, e))
}

/// Every listening socket, bound before anything is served.
struct Listeners {
    /// One per worker thread (`SO_REUSEPORT`), when there is an upstream.
    proxy: Vec<std::net::TcpListener>,
    admin: TcpListener,
    grpc: Option<TcpListener>,
    check: Option<TcpListener>,
    /// `--listen` without a proxy answers health probes only, where
    /// envoyproxy/ratelimit's does.
    health: Option<TcpListener>,
}

impl Listeners {
    async fn bind(
        settings: &Settings,
        proxy: bool,
        grpc: Option<SocketAddr>,
        check: Option<SocketAddr>,
        threads: usize,
    ) -> Result<Listeners, StartError> {
        let (proxy, health) = match proxy {
            true => (workers::bind_shared(settings.listen, threads)?, None),
            false => (Vec::new(), Some(bind(settings.listen).await?)),
        };
        Ok(Listeners {
            proxy,
            admin: bind(settings.admin_listen).await?,
            grpc: bind_some(grpc).await?,
            check: bind_some(check).await?,
            health,
        })
    }

    /// Where each listens (port 0 resolved), said in one log line.
    fn addresses(&self, admin: SocketAddr) -> Result<Addresses, StartError> {
        let local = |l: &Option<TcpListener>| l.as_ref().and_then(|l| l.local_addr().ok());
        let addresses = Addresses {
            proxy: self.proxy.first().and_then(|l| l.local_addr().ok()),
            admin: self.admin.local_addr().map_err(|e| StartError::Listen(admin, e))?,
            grpc: local(&self.grpc),
            check: local(&self.check),
            health: local(&self.health),
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
        Ok(addresses)
    }
}

/// What every listener and worker shares.
struct Parts {
    limiter: Arc<Limiter>,
    catalog: crate::limits::SharedCatalog,
    files: Arc<LiveFiles>,
    trusted: TrustedProxies,
    conn_limits: ConnLimits,
    proxy_gate: Gate,
    stop: watch::Receiver<bool>,
}

/// Senders that deal gRPC connections to the worker threads.
type GrpcWorkers = Vec<mpsc::UnboundedSender<std::net::TcpStream>>;

impl Parts {
    /// Starts the worker threads: each serves its proxy listener (when
    /// there is one) and the gRPC connections dealt to it.
    fn start_workers(
        &self,
        settings: &Settings,
        proxy_listeners: Vec<std::net::TcpListener>,
        options: Option<ProxyOptions>,
        grpc: bool,
        threads: usize,
        tls: &Tls,
    ) -> Result<(Vec<std::thread::JoinHandle<()>>, GrpcWorkers), StartError> {
        let mut proxy_listeners = proxy_listeners.into_iter();
        let mut handles = Vec::with_capacity(threads);
        let mut grpc_workers = Vec::new();
        for i in 0..threads {
            let proxy = match (proxy_listeners.next(), &options) {
                (Some(listener), Some(options)) => Some((
                    listener,
                    Proxy::new(self.limiter.clone(), self.catalog.clone(), options.clone()),
                )),
                _ => None,
            };
            let grpc = grpc.then(|| {
                let (conns, incoming) = mpsc::unbounded_channel();
                grpc_workers.push(conns);
                let rls = RlsService::new(self.limiter.clone(), self.catalog.clone())
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
                tls: tls.http.clone(),
                grpc_tls: tls.grpc.clone(),
                grpc,
                limits: self.conn_limits,
                gate: self.proxy_gate.clone(),
                stop: self.stop.clone(),
            };
            let handle = std::thread::Builder::new()
                .name(format!("proxy-{i}"))
                .spawn(move || worker.run())
                .map_err(StartError::Thread)?;
            handles.push(handle);
        }
        Ok((handles, grpc_workers))
    }

    /// Serves the admin, decision and health listeners on the main runtime,
    /// and deals gRPC connections to the workers.
    fn serve_listeners(
        &self,
        settings: &Settings,
        admin: TcpListener,
        check: Option<TcpListener>,
        health: Option<TcpListener>,
        grpc: Option<(TcpListener, GrpcWorkers)>,
        tls: &Tls,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        if !settings.admin_listen.ip().is_loopback() && settings.admin_token.is_none() {
            tracing::warn!(admin = %settings.admin_listen, "admin listener is reachable beyond loopback without --admin-token; /config and /metrics are open to anyone who can reach it");
        }
        let access = AdminAccess {
            token: settings.admin_token.clone(),
            hosts: settings.admin_hosts.clone(),
        };
        let admin_handler = Arc::new(
            Admin::new(self.limiter.clone(), self.files.clone(), access)
                .with_tls(tls.cert.clone())
                .with_rls_modes(settings.rls_quota_mode, settings.rls_shadow_mode),
        );
        let mut tasks = vec![tokio::spawn(serve(
            admin,
            self.conn_limits,
            // Bounded: each answer is held whole until its reader takes it,
            // so readers that stall cannot grow memory without end.
            Gate::new("admin", Some(ADMIN_CONNECTIONS)),
            None,
            self.stop.clone(),
            move |req, peer| {
                let admin = admin_handler.clone();
                async move { admin.handle(req, peer).await }
            },
        ))];
        if let Some(listener) = check {
            let check = Arc::new(DecisionHttp::new(
                self.limiter.clone(),
                self.catalog.clone(),
                self.trusted.clone(),
            ));
            // Whatever NGINX or Envoy accepted from a client and passes on
            // must be read here: a 431 would turn into "the check failed",
            // which the proxy in front may answer by letting the request through.
            let check_limits = ConnLimits {
                max_headers: 1024,
                max_header_bytes: 256 * 1024,
                ..self.conn_limits
            };
            tasks.push(tokio::spawn(serve(
                listener,
                check_limits,
                Gate::new("check", None),
                tls.http.clone().filter(|_| settings.check_tls),
                self.stop.clone(),
                move |req, peer| {
                    let check = check.clone();
                    async move { check.handle(req, peer).await }
                },
            )));
        }
        if let Some(listener) = health {
            tasks.push(tokio::spawn(serve(
                listener,
                self.conn_limits,
                Gate::new("health", None),
                None,
                self.stop.clone(),
                Admin::health_only,
            )));
        }
        if let Some((listener, workers)) = grpc {
            tasks.push(tokio::spawn(workers::deal_grpc(listener, workers, self.stop.clone())));
        }
        tasks
    }
}

async fn bind_some(addr: Option<SocketAddr>) -> Result<Option<TcpListener>, StartError> {
    match addr {
        Some(addr) => Ok(Some(bind(addr).await?)),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests;
