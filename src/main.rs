//! The `tollgate` command: flags, wiring and signals. All behaviour lives in
//! the library; this file only connects the parts.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{ArgAction, Parser, Subcommand, ValueEnum};
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use tollgate::admin::{Admin, AdminAccess};
use tollgate::client_ip::TrustedProxies;
use tollgate::limiter::{Limiter, MemoryStore, RedisMode, RedisStore, Store, SystemClock};
use tollgate::reload::LiveFiles;
use tollgate::serve::{ConnLimits, serve};
use tollgate::surfaces::decision_http::DecisionHttp;
use tollgate::surfaces::envoy_rls::RlsService;
use tollgate::surfaces::proxy::{Proxy, ProxyOptions, Upstream};

// Many small short-lived allocations per request (headers, keys); glibc's
// allocator showed up at ~5% of proxy CPU in profiles, mimalloc much less.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "tollgate",
    version,
    about = "HTTP rate-limit sidecar with exact sliding windows"
)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a limits file and exit (non-zero with file:line: reason on error).
    Check {
        /// Limits files (YAML or JSON; tollgate's format or envoyproxy/ratelimit's).
        #[arg(long, env = "TOLLGATE_CONFIG", value_delimiter = ',', required = true)]
        config: Vec<PathBuf>,
        /// Merge envoyproxy/ratelimit files that declare the same domain.
        #[arg(long, env = "TOLLGATE_MERGE_DOMAIN_CONFIG", default_value_t = false, action = ArgAction::Set)]
        merge_domain_config: bool,
    },
}

#[derive(clap::Args)]
struct RunArgs {
    /// Limits file (YAML or JSON; tollgate's format or envoyproxy/ratelimit's).
    /// Repeat for several domains, one file each.
    #[arg(long, env = "TOLLGATE_CONFIG", value_delimiter = ',', required = true)]
    config: Vec<PathBuf>,
    /// Most counters the in-memory store holds (without --redis): beyond it,
    /// the least recently used of a sample is forgotten and its caller
    /// starts a fresh window. ~250 bytes each holding a request or two, and
    /// ~20 bytes more per request admitted in the counter's longest window.
    #[arg(long, env = "TOLLGATE_MAX_COUNTERS", default_value_t = tollgate::limiter::DEFAULT_MAX_COUNTERS)]
    max_counters: usize,
    /// Merge envoyproxy/ratelimit files that declare the same domain (their
    /// MERGE_DOMAIN_CONFIG); otherwise one domain, one file.
    #[arg(long, env = "TOLLGATE_MERGE_DOMAIN_CONFIG", default_value_t = false, action = ArgAction::Set)]
    merge_domain_config: bool,
    /// Where admitted requests go, as http://host:port. Without it tollgate
    /// is a pure rate limit service: no proxy, only the decision listeners
    /// (the RLS then listens on 0.0.0.0:8081, as envoyproxy/ratelimit does).
    #[arg(long, env = "TOLLGATE_UPSTREAM")]
    upstream: Option<String>,
    /// Address the proxy listens on.
    #[arg(long, env = "TOLLGATE_LISTEN", default_value = "0.0.0.0:8080")]
    listen: SocketAddr,
    /// Envoy RLS gRPC listener (ShouldRateLimit and grpc.health.v1), or "off".
    /// 127.0.0.1:8081 beside a proxy (whoever reaches it can charge any
    /// caller's counters with descriptors of their choosing), 0.0.0.0:8081
    /// without --upstream.
    #[arg(long, env = "TOLLGATE_GRPC_LISTEN", value_parser = parse_listen)]
    grpc_listen: Option<Listen>,
    /// HTTP decision listener: /ext_authz/<path> for Envoy, /auth_request for NGINX (off unless given).
    #[arg(long, env = "TOLLGATE_CHECK_LISTEN", value_parser = parse_listen)]
    check_listen: Option<Listen>,
    /// Answer RLS requests with dynamic metadata: the request's domain and
    /// descriptors and the `metadata` of the limits it passed
    /// (envoyproxy/ratelimit's RESPONSE_DYNAMIC_METADATA).
    #[arg(long, env = "TOLLGATE_RLS_DYNAMIC_METADATA", default_value_t = false, action = ArgAction::Set)]
    rls_dynamic_metadata: bool,
    /// Answer every RLS request OK while still reporting each descriptor's
    /// status (envoyproxy/ratelimit's SHADOW_MODE): a dry run of new limits.
    #[arg(long, env = "TOLLGATE_RLS_SHADOW_MODE", default_value_t = false, action = ArgAction::Set)]
    rls_shadow_mode: bool,
    /// Treat every RLS limit as quota_mode: a request is refused only when
    /// all its limits are over (envoyproxy/ratelimit's QUOTA_MODE).
    #[arg(long, env = "TOLLGATE_RLS_QUOTA_MODE", default_value_t = false, action = ArgAction::Set)]
    rls_quota_mode: bool,
    /// RLS answers carry the RateLimit headers for Envoy to add to the
    /// response (envoyproxy/ratelimit's LIMIT_RESPONSE_HEADERS_ENABLED).
    #[arg(long, env = "TOLLGATE_RLS_HEADERS", default_value_t = true, action = ArgAction::Set)]
    rls_headers: bool,
    /// Address of the admin listener (/healthz, /readyz, /config).
    #[arg(long, env = "TOLLGATE_ADMIN_LISTEN", default_value = "127.0.0.1:9901")]
    admin_listen: SocketAddr,
    /// Require `Authorization: Bearer <token>` on the admin listener (all but /healthz and /readyz).
    #[arg(long, env = "TOLLGATE_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Host names the admin listener answers to besides IP literals and localhost (comma-separated).
    #[arg(long, env = "TOLLGATE_ADMIN_HOSTS", value_delimiter = ',')]
    admin_hosts: Vec<String>,
    /// Keep counters in Redis (redis[s]://[user:password@]host:port/db), shared
    /// by every instance; without it counters live in this process. Several
    /// comma-separated URLs for Cluster seed nodes or Sentinels.
    #[arg(long, env = "TOLLGATE_REDIS", value_delimiter = ',')]
    redis: Vec<String>,
    /// How --redis is read: one server, Cluster seed nodes, or Sentinels.
    #[arg(long, env = "TOLLGATE_REDIS_MODE", default_value = "standalone")]
    redis_mode: RedisModeArg,
    /// With --redis-mode sentinel: the monitored master's name.
    #[arg(long, env = "TOLLGATE_REDIS_MASTER", default_value = "mymaster")]
    redis_master: String,
    /// Deadline of one decision; past it the rule's failure mode applies.
    #[arg(long, env = "TOLLGATE_REDIS_TIMEOUT", default_value = "50ms", value_parser = humantime::parse_duration)]
    redis_timeout: Duration,
    /// Worker threads, each with its own proxy listening socket (SO_REUSEPORT),
    /// upstream pool and Redis connection, also serving the gRPC connections
    /// dealt to it, so a request stays on one thread; 0 = one per core.
    #[arg(long, env = "TOLLGATE_PROXY_THREADS", default_value_t = 0)]
    proxy_threads: usize,
    /// Longest wait for the upstream's response headers once the request has been sent (then 504).
    #[arg(long, env = "TOLLGATE_UPSTREAM_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    upstream_timeout: Duration,
    /// Longest wait between two pieces of a request or response body; then
    /// the stalled side is cut off (and counted).
    #[arg(long, env = "TOLLGATE_UPSTREAM_BODY_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    upstream_body_timeout: Duration,
    /// Proxies whose X-Forwarded-For / X-Real-IP are believed (comma-separated CIDRs).
    #[arg(long, env = "TOLLGATE_TRUSTED_PROXIES", value_delimiter = ',')]
    trusted_proxies: Vec<String>,
    /// Add RateLimit / RateLimit-Policy to admitted responses.
    #[arg(long, env = "TOLLGATE_RATELIMIT_HEADERS", default_value_t = true, action = ArgAction::Set)]
    ratelimit_headers: bool,
    /// How long a client may take to send request headers.
    #[arg(long, env = "TOLLGATE_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    header_read_timeout: Duration,
    /// How long in-flight requests may finish after SIGTERM.
    #[arg(long, env = "TOLLGATE_SHUTDOWN_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    shutdown_timeout: Duration,
    /// Reload the limits file when it changes (SIGHUP always reloads).
    #[arg(long, env = "TOLLGATE_WATCH_CONFIG", default_value_t = true, action = ArgAction::Set)]
    watch_config: bool,
    /// Log format.
    #[arg(long, env = "TOLLGATE_LOG_FORMAT", default_value = "human")]
    log_format: LogFormat,
}

/// A listener address, or `off`.
#[derive(Clone, Copy)]
struct Listen(Option<SocketAddr>);

fn parse_listen(text: &str) -> Result<Listen, String> {
    match text {
        "off" | "" => Ok(Listen(None)),
        _ => text
            .parse()
            .map(|a| Listen(Some(a)))
            .map_err(|e| format!("{e} (or \"off\")")),
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum RedisModeArg {
    Standalone,
    Cluster,
    Sentinel,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Human,
    Json,
}

fn main() -> ExitCode {
    let get = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if argv.get(1).and_then(|a| a.to_str()) != Some("check") {
        if let Some(problem) = tollgate::ratelimit_env::unsupported(get) {
            eprintln!("tollgate: {problem}");
            return ExitCode::FAILURE;
        }
        let extra = tollgate::ratelimit_env::flags(get, &argv);
        argv.extend(extra.into_iter().map(Into::into));
    }
    let cli = Cli::parse_from(argv);
    match cli.command {
        Some(Command::Check {
            config,
            merge_domain_config,
        }) => check(&config, merge_domain_config),
        None => {
            init_logging(cli.run.log_format);
            let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("tollgate: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(run(cli.run)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("{e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn check(paths: &[PathBuf], merge: bool) -> ExitCode {
    match LiveFiles::load(paths, merge) {
        Ok(catalog) => {
            for f in catalog.files().iter() {
                let limits = f.active().load();
                println!(
                    "{}: ok (domain {}, {} rules)",
                    f.status().file,
                    limits.domain,
                    limits.rules.len()
                );
                for warning in tollgate::config::surface_warnings(&limits) {
                    eprintln!("{}: warning: {warning}", f.status().file);
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(format: LogFormat) {
    let fallback = tollgate::ratelimit_env::log_filter(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
        .unwrap_or_else(|| "info".into());
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(fallback));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let upstream = args.upstream.as_deref().map(Upstream::parse).transpose()?;
    let grpc_listen = args.grpc_listen.unwrap_or_else(|| {
        let ip = if upstream.is_some() {
            [127, 0, 0, 1]
        } else {
            [0, 0, 0, 0]
        };
        Listen(Some(SocketAddr::from((ip, 8081))))
    });
    if upstream.is_none() && grpc_listen.0.is_none() && args.check_listen.as_ref().and_then(|l| l.0).is_none() {
        anyhow::bail!(
            "nothing to serve: give --upstream, or leave a decision listener (--grpc-listen, --check-listen) on"
        );
    }
    let trusted = TrustedProxies::parse(&args.trusted_proxies).context("--trusted-proxies")?;
    let files = Arc::new(LiveFiles::load(&args.config, args.merge_domain_config).map_err(|e| anyhow::anyhow!("{e}"))?);
    for f in files.files().iter() {
        let limits = f.active().load();
        let status = f.status();
        tracing::info!(file = %status.file, domain = %limits.domain, format = ?limits.format, rules = limits.rules.len(), version = %status.version, "limits loaded");
    }
    let catalog = files.catalog();
    let _watch = if args.watch_config {
        Some(files.watch().context("cannot watch the limits files")?)
    } else {
        None
    };

    let store = match args.redis.is_empty() {
        false => {
            let mode = match args.redis_mode {
                RedisModeArg::Standalone => RedisMode::Standalone,
                RedisModeArg::Cluster => RedisMode::Cluster,
                RedisModeArg::Sentinel => RedisMode::Sentinel {
                    master: args.redis_master.clone(),
                },
            };
            let store = RedisStore::connect(&args.redis, &mode, None).context("--redis")?;
            tracing::info!(servers = store.server(), mode = ?mode, "counters in redis");
            Store::Redis(store)
        }
        true => {
            tracing::info!(
                max_counters = args.max_counters,
                "counters in memory (single instance; pass --redis to share them)"
            );
            Store::Memory(MemoryStore::new(Arc::new(SystemClock::default())).with_max_counters(args.max_counters))
        }
    };
    let limiter = Arc::new(Limiter::new(store, args.redis_timeout));
    // Cached denials were exact for the old limits only.
    let forget = limiter.clone();
    files.on_change(move || forget.forget_denials());

    let threads = match args.proxy_threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    // A pure rate limit service has no proxy: its --listen port answers
    // health probes only, where envoyproxy/ratelimit's do.
    let (proxy_listeners, health_listener) = match upstream {
        Some(_) => (bind_shared(args.listen, threads).await?, None),
        None => (Vec::new(), Some(bind(args.listen).await?)),
    };
    let admin_listener = bind(args.admin_listen).await?;
    let grpc_listener = match grpc_listen.0 {
        Some(addr) => Some(bind(addr).await?),
        None => None,
    };
    let check_listener = match args.check_listen.and_then(|l| l.0) {
        Some(addr) => Some(bind(addr).await?),
        None => None,
    };
    let shown = |l: &Option<TcpListener>| {
        l.as_ref()
            .and_then(|l| l.local_addr().ok())
            .map_or("off".to_string(), |a| a.to_string())
    };
    tracing::info!(
        proxy = %proxy_listeners.first().and_then(|l| l.local_addr().ok()).map_or("off".to_string(), |a| a.to_string()),
        admin = %admin_listener.local_addr()?,
        grpc = %shown(&grpc_listener),
        health = %shown(&health_listener),
        check = %shown(&check_listener),
        "listening"
    );

    let conn_limits = ConnLimits {
        header_read_timeout: args.header_read_timeout,
        shutdown_grace: args.shutdown_timeout,
        ..ConnLimits::default()
    };
    let (stop_tx, stop_rx) = watch::channel(false);

    let options = upstream.map(|upstream| ProxyOptions {
        upstream,
        upstream_timeout: args.upstream_timeout,
        body_timeout: args.upstream_body_timeout,
        trusted: trusted.clone(),
        ratelimit_headers: args.ratelimit_headers,
    });
    // Threads serve the proxy listener (when there is one) and the gRPC
    // connections dealt to them.
    let mut proxy_listeners = proxy_listeners.into_iter();
    let mut proxy_threads = Vec::with_capacity(threads);
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
            (
                incoming,
                RlsService::new(limiter.clone(), catalog.clone())
                    .with_dynamic_metadata(args.rls_dynamic_metadata)
                    .with_shadow_mode(args.rls_shadow_mode)
                    .with_quota_mode(args.rls_quota_mode)
                    .with_headers(args.rls_headers),
            )
        });
        if proxy.is_none() && grpc.is_none() {
            break;
        }
        let stop = stop_rx.clone();
        let thread = std::thread::Builder::new()
            .name(format!("proxy-{i}"))
            .spawn(move || serve_proxy_thread(proxy, grpc, conn_limits, stop));
        proxy_threads.push(thread.context("cannot start a proxy thread")?);
    }
    if !args.admin_listen.ip().is_loopback() && args.admin_token.is_none() {
        tracing::warn!(admin = %args.admin_listen, "admin listener is reachable beyond loopback without --admin-token; /config and /metrics are open to anyone who can reach it");
    }
    let access = AdminAccess {
        token: args.admin_token.clone(),
        hosts: args.admin_hosts.clone(),
    };
    let admin = Arc::new(Admin::new(limiter.clone(), files.clone(), access));

    let admin_task = tokio::spawn(serve(admin_listener, conn_limits, stop_rx.clone(), move |req, peer| {
        let admin = admin.clone();
        async move { admin.handle(req, peer).await }
    }));

    let mut tasks = vec![admin_task];
    if let Some(listener) = check_listener {
        let check = Arc::new(DecisionHttp::new(limiter.clone(), catalog.clone(), trusted));
        // Whatever NGINX or Envoy accepted from a client and passes on must
        // be read here: a 431 would turn into "the check failed", which the
        // proxy in front may answer by letting the request through.
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
        tasks.push(tokio::spawn(deal_grpc(listener, grpc_workers, stop_rx.clone())));
    }

    wait_for_stop(&files).await;
    tracing::info!(grace = ?args.shutdown_timeout, "shutting down: no new connections, finishing requests in flight");
    let _ = stop_tx.send(true);
    for task in tasks {
        let _ = task.await;
    }
    let _ = tokio::task::spawn_blocking(move || {
        for thread in proxy_threads {
            let _ = thread.join();
        }
    })
    .await;
    tracing::info!("stopped");
    Ok(())
}

/// `n` listening sockets on one address (SO_REUSEPORT): the kernel spreads
/// connections over them. With port 0 all share the port the first got.
async fn bind_shared(addr: SocketAddr, n: usize) -> anyhow::Result<Vec<std::net::TcpListener>> {
    let mut addr = addr;
    let mut listeners = Vec::with_capacity(n);
    for _ in 0..n {
        let socket = if addr.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        socket.set_reuseport(true)?;
        socket.bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
        let listener = socket.listen(1024)?;
        addr = listener.local_addr()?;
        listeners.push(listener.into_std()?);
    }
    Ok(listeners)
}

/// One proxy thread: its own single-threaded runtime, listener and upstream
/// pool, so a request never hops between threads (as NGINX workers). It
/// also serves the gRPC connections dealt to it.
fn serve_proxy_thread(
    proxy: Option<(std::net::TcpListener, Proxy)>,
    grpc: Option<(mpsc::UnboundedReceiver<std::net::TcpStream>, RlsService)>,
    limits: ConnLimits,
    stop: watch::Receiver<bool>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "cannot start a proxy thread's runtime");
            return;
        }
    };
    runtime.block_on(async move {
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
            serve(listener, limits, stop.clone(), move |req, peer| {
                let proxy = proxy.clone();
                async move { proxy.handle(req, peer).await }
            })
            .await
        };
        match grpc {
            Some((incoming, rls)) => {
                tokio::join!(
                    http,
                    serve_grpc(incoming, rls, stop.clone(), limits.header_read_timeout)
                );
            }
            None => http.await,
        }
    });
}

/// Accepts gRPC connections and deals them to the proxy threads in turn.
/// Envoy keeps a few long-lived HTTP/2 connections to its rate limit
/// service: too few for `SO_REUSEPORT`'s hash to spread them evenly.
async fn deal_grpc(
    listener: TcpListener,
    mut workers: Vec<mpsc::UnboundedSender<std::net::TcpStream>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut next = 0usize;
    loop {
        let accepted = tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, mostly: wait instead of spinning.
                tracing::warn!(error = %e, "cannot accept a gRPC connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Nagle's algorithm would hold small replies back until a delayed
        // ACK (~40 ms tails under load), so it is off as on every listener.
        let _ = stream.set_nodelay(true);
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

async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))
}

/// Serves Envoy RLS and gRPC health on the connections dealt to this thread
/// until `stop` turns true.
async fn serve_grpc(
    incoming: mpsc::UnboundedReceiver<std::net::TcpStream>,
    rls: RlsService,
    mut stop: watch::Receiver<bool>,
    ping_every: Duration,
) {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<RateLimitServiceServer<RlsService>>().await;
    // The service name envoyproxy/ratelimit reports health under.
    reporter
        .set_service_status("ratelimit", tonic_health::ServingStatus::Serving)
        .await;
    let incoming = UnboundedReceiverStream::new(incoming).map(tokio::net::TcpStream::from_std);
    // A peer that stops answering HTTP/2 PINGs (a slow-loris that sent a
    // preface and never a whole request) is closed; Envoy answers them.
    let result = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(ping_every))
        .http2_keepalive_timeout(Some(ping_every))
        .add_service(health)
        .add_service(RateLimitServiceServer::new(rls))
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await;
    if let Err(e) = result {
        tracing::error!(error = %e, "gRPC server failed");
    }
}

/// Waits for SIGTERM or SIGINT, reloading the limits on every SIGHUP.
async fn wait_for_stop(files: &Arc<LiveFiles>) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) else {
        tracing::warn!("cannot install signal handlers; stop with SIGKILL");
        std::future::pending::<()>().await;
        return;
    };
    loop {
        tokio::select! {
            _ = term.recv() => return,
            _ = int.recv() => return,
            _ = hup.recv() => {
                let files = files.clone();
                let _ = tokio::task::spawn_blocking(move || files.reload_all("SIGHUP")).await;
            }
        }
    }
}
