//! The settings tollgate runs with: every flag, its `TOLLGATE_*`
//! environment variable and its default, in one place. `main` parses them;
//! [`crate::server`] runs what they describe.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Parser, Subcommand, ValueEnum};

/// The `tollgate` command line.
#[derive(Parser)]
#[command(
    name = "tollgate",
    version,
    about = "HTTP rate-limit sidecar with exact sliding windows"
)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct Cli {
    /// A subcommand, or none to run.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// What to run with.
    #[command(flatten)]
    pub run: Settings,
}

/// What `tollgate <command>` does instead of running.
#[derive(Subcommand)]
pub enum Command {
    /// Validate a limits file and exit (non-zero with file:line: reason on error).
    Check {
        /// Limits files (YAML or JSON; tollgate's format or envoyproxy/ratelimit's).
        #[arg(long, env = "TOLLGATE_CONFIG", value_delimiter = ',', required = true)]
        config: Vec<PathBuf>,
        /// Merge envoyproxy/ratelimit files that declare the same domain.
        #[arg(long, env = "TOLLGATE_MERGE_DOMAIN_CONFIG", default_value_t = false, action = ArgAction::Set)]
        merge_domain_config: bool,
    },
    /// Ask a running tollgate what a request would get now, charging nothing:
    /// which rules match, which counter each uses, and every window's use.
    Explain(Box<ExplainArgs>),
}

/// `tollgate explain`: an HTTP request (`-X`, `-H`, `--host`, `--client`,
/// PATH) or an Envoy RLS one (`--domain`, `--descriptor`).
#[derive(clap::Args, Clone, Debug)]
pub struct ExplainArgs {
    /// The running tollgate's admin listener, `host:port`.
    #[arg(long, env = "TOLLGATE_ADMIN_LISTEN", default_value = "127.0.0.1:9901")]
    pub admin: String,
    /// Its `--admin-token`, if it has one.
    #[arg(long, env = "TOLLGATE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// The request's method.
    #[arg(short = 'X', long, default_value = "GET")]
    pub method: String,
    /// A request header, `Name: value` (repeat for more).
    #[arg(short = 'H', long = "header")]
    pub headers: Vec<String>,
    /// The host the request is for.
    #[arg(long)]
    pub host: Option<String>,
    /// The client's address, as tollgate resolves it (after trusted proxies).
    #[arg(long, default_value = "127.0.0.1")]
    pub client: String,
    /// The path, with its query if any.
    #[arg(default_value = "/")]
    pub path: String,
    /// An Envoy RLS domain: ask about descriptors instead of an HTTP request.
    #[arg(long, conflicts_with_all = ["method", "headers", "host", "client", "path"])]
    pub domain: Option<String>,
    /// An RLS descriptor, `key=value,key=value` (repeat for more).
    #[arg(long = "descriptor", requires = "domain")]
    pub descriptors: Vec<String>,
    /// Units each descriptor asks for (its own hits_addend, as the RLS
    /// takes it: 0 checks without charging).
    #[arg(long, default_value_t = 1)]
    pub hits_addend: u64,
    /// Print the admin listener's JSON answer as it came.
    #[arg(long)]
    pub json: bool,
}

/// Everything `tollgate` is started with (each flag also read from its
/// `TOLLGATE_*` environment variable).
#[derive(Parser, Clone, Debug)]
#[command(name = "tollgate")]
pub struct Settings {
    /// Limits file (YAML or JSON; tollgate's format or envoyproxy/ratelimit's).
    /// Repeat for several domains, one file each.
    #[arg(long, env = "TOLLGATE_CONFIG", value_delimiter = ',', required = true)]
    pub config: Vec<PathBuf>,
    /// Most counters the in-memory store holds (without --redis): beyond it,
    /// the least recently used of a sample is forgotten and its caller
    /// starts a fresh window. ~250 bytes each holding a request or two, and
    /// ~20 bytes more per request admitted in the counter's longest window.
    #[arg(long, env = "TOLLGATE_MAX_COUNTERS", default_value_t = crate::limiter::DEFAULT_MAX_COUNTERS)]
    pub max_counters: usize,
    /// Merge envoyproxy/ratelimit files that declare the same domain (their
    /// MERGE_DOMAIN_CONFIG); otherwise one domain, one file.
    #[arg(long, env = "TOLLGATE_MERGE_DOMAIN_CONFIG", default_value_t = false, action = ArgAction::Set)]
    pub merge_domain_config: bool,
    /// Where admitted requests go, as http://host:port or https://host:port
    /// (verified; see --upstream-ca). Without it tollgate
    /// is a pure rate limit service: no proxy, only the decision listeners
    /// (the RLS then listens on 0.0.0.0:8081, as envoyproxy/ratelimit does).
    #[arg(long, env = "TOLLGATE_UPSTREAM")]
    pub upstream: Option<String>,
    /// Address the proxy listens on.
    #[arg(long, env = "TOLLGATE_LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,
    /// Serve HTTPS on the proxy listener with this certificate chain (PEM,
    /// leaf first); reloaded when the file changes.
    #[arg(long, env = "TOLLGATE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1); reloaded with it.
    #[arg(long, env = "TOLLGATE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Ask TLS clients for a certificate signed by this CA (PEM).
    #[arg(long, env = "TOLLGATE_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// With --tls-client-ca: whether a client must present a certificate.
    #[arg(
        long,
        env = "TOLLGATE_TLS_CLIENT_AUTH",
        default_value = "required",
        requires = "tls_client_ca"
    )]
    pub tls_client_auth: ClientAuthArg,
    /// Serve the check listener (--check-listen) over TLS too, with the same certificate.
    #[arg(long, env = "TOLLGATE_CHECK_TLS", default_value_t = false, action = ArgAction::Set, requires = "tls_cert")]
    pub check_tls: bool,
    /// Serve the gRPC listener (--grpc-listen) over TLS too, with the same certificate (ALPN h2).
    #[arg(long, env = "TOLLGATE_GRPC_TLS", default_value_t = false, action = ArgAction::Set, requires = "tls_cert")]
    pub grpc_tls: bool,
    /// Verify an https:// --upstream against this CA bundle (PEM) instead of the system's roots.
    #[arg(long, env = "TOLLGATE_UPSTREAM_CA")]
    pub upstream_ca: Option<PathBuf>,
    /// Envoy RLS gRPC listener (ShouldRateLimit and grpc.health.v1), or "off".
    /// 127.0.0.1:8081 beside a proxy (whoever reaches it can charge any
    /// caller's counters with descriptors of their choosing), 0.0.0.0:8081
    /// without --upstream.
    #[arg(long, env = "TOLLGATE_GRPC_LISTEN", value_parser = parse_listen)]
    pub grpc_listen: Option<Listen>,
    /// HTTP decision listener: /ext_authz/<path> for Envoy, /auth_request for NGINX (off unless given).
    #[arg(long, env = "TOLLGATE_CHECK_LISTEN", value_parser = parse_listen)]
    pub check_listen: Option<Listen>,
    /// Answer RLS requests with dynamic metadata: the request's domain and
    /// descriptors and the `metadata` of the limits it passed
    /// (envoyproxy/ratelimit's RESPONSE_DYNAMIC_METADATA).
    #[arg(long, env = "TOLLGATE_RLS_DYNAMIC_METADATA", default_value_t = false, action = ArgAction::Set)]
    pub rls_dynamic_metadata: bool,
    /// Answer every RLS request OK while still reporting each descriptor's
    /// status (envoyproxy/ratelimit's SHADOW_MODE): a dry run of new limits.
    #[arg(long, env = "TOLLGATE_RLS_SHADOW_MODE", default_value_t = false, action = ArgAction::Set)]
    pub rls_shadow_mode: bool,
    /// Treat every RLS limit as quota_mode: a request is refused only when
    /// all its limits are over (envoyproxy/ratelimit's QUOTA_MODE).
    #[arg(long, env = "TOLLGATE_RLS_QUOTA_MODE", default_value_t = false, action = ArgAction::Set)]
    pub rls_quota_mode: bool,
    /// RLS answers carry the RateLimit headers for Envoy to add to the
    /// response (envoyproxy/ratelimit's LIMIT_RESPONSE_HEADERS_ENABLED).
    #[arg(long, env = "TOLLGATE_RLS_HEADERS", default_value_t = true, action = ArgAction::Set)]
    pub rls_headers: bool,
    /// Address of the admin listener (/healthz, /readyz, /config).
    #[arg(long, env = "TOLLGATE_ADMIN_LISTEN", default_value = "127.0.0.1:9901")]
    pub admin_listen: SocketAddr,
    /// Require `Authorization: Bearer <token>` on the admin listener (all but /healthz and /readyz).
    /// Refused at start when no client could send it (empty, edged with
    /// spaces, not visible ASCII).
    #[arg(long, env = "TOLLGATE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Host names the admin listener answers to besides IP literals and localhost (comma-separated).
    #[arg(long, env = "TOLLGATE_ADMIN_HOSTS", value_delimiter = ',')]
    pub admin_hosts: Vec<String>,
    /// Keep counters in Redis (redis[s]://[user:password@]host:port/db), shared
    /// by every instance; without it counters live in this process. Several
    /// comma-separated URLs for Cluster seed nodes or Sentinels.
    #[arg(long, env = "TOLLGATE_REDIS", value_delimiter = ',')]
    pub redis: Vec<String>,
    /// How --redis is read: one server, Cluster seed nodes, or Sentinels.
    #[arg(long, env = "TOLLGATE_REDIS_MODE", default_value = "standalone")]
    pub redis_mode: RedisModeArg,
    /// With --redis-mode sentinel: the monitored master's name.
    #[arg(long, env = "TOLLGATE_REDIS_MASTER", default_value = "mymaster")]
    pub redis_master: String,
    /// With --redis-mode sentinel: the Sentinels' own login (`password` or
    /// `user:password`, their `requirepass`); the login in --redis is the master's.
    #[arg(long, env = "TOLLGATE_REDIS_SENTINEL_AUTH", hide_env_values = true)]
    pub redis_sentinel_auth: Option<String>,
    /// Deadline of one decision; past it the rule's failure mode applies.
    #[arg(long, env = "TOLLGATE_REDIS_TIMEOUT", default_value = "50ms", value_parser = parse_decision_deadline)]
    pub redis_timeout: Duration,
    /// Worker threads, each with its own proxy listening socket (SO_REUSEPORT),
    /// upstream pool and Redis connection, also serving the gRPC connections
    /// dealt to it, so a request stays on one thread; 0 = one per core.
    #[arg(long, env = "TOLLGATE_PROXY_THREADS", default_value_t = 0)]
    pub proxy_threads: usize,
    /// Longest wait for the upstream's response headers once the request has been sent (then 504).
    #[arg(long, env = "TOLLGATE_UPSTREAM_TIMEOUT", default_value = "30s", value_parser = parse_upstream_timeout)]
    pub upstream_timeout: Duration,
    /// Longest wait between two pieces of a request or response body; then
    /// the stalled side is cut off (and counted).
    #[arg(long, env = "TOLLGATE_UPSTREAM_BODY_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    pub upstream_body_timeout: Duration,
    /// Most idle keep-alive connections to the upstream each proxy thread
    /// keeps for the next requests, as NGINX's upstream `keepalive` per
    /// worker; a burst's surplus is closed as its responses end (0: a new
    /// connection for every request).
    #[arg(long, env = "TOLLGATE_UPSTREAM_KEEPALIVE", default_value_t = 64)]
    pub upstream_keepalive: usize,
    /// How long an idle HTTP/1.1 upstream connection is kept for reuse, as
    /// NGINX's upstream `keepalive_timeout`: set it below the upstream's own
    /// idle timeout (Node's 5 s) so tollgate closes first and never sends on
    /// a connection the upstream is closing (0: no reuse). An HTTP/2
    /// upstream's one connection is kept while it lasts.
    #[arg(long, env = "TOLLGATE_UPSTREAM_KEEPALIVE_TIMEOUT", default_value = "50s", value_parser = humantime::parse_duration)]
    pub upstream_keepalive_timeout: Duration,
    /// Proxies whose X-Forwarded-For / X-Real-IP are believed (comma-separated CIDRs).
    #[arg(long, env = "TOLLGATE_TRUSTED_PROXIES", value_delimiter = ',')]
    pub trusted_proxies: Vec<String>,
    /// Add RateLimit / RateLimit-Policy to admitted responses.
    #[arg(long, env = "TOLLGATE_RATELIMIT_HEADERS", default_value_t = true, action = ArgAction::Set)]
    pub ratelimit_headers: bool,
    /// How long a client may take to send request headers.
    #[arg(long, env = "TOLLGATE_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub header_read_timeout: Duration,
    /// Most client connections the proxy holds open; more wait in the
    /// listen backlog until one closes. 0: half the file-descriptor limit
    /// (raised to its hard limit at start), leaving one for each upstream
    /// connection.
    #[arg(long, env = "TOLLGATE_MAX_CONNECTIONS", default_value_t = 0)]
    pub max_connections: usize,
    /// How long an idle keep-alive client connection stays open (0: no
    /// keep-alive, as NGINX's keepalive_timeout 0).
    #[arg(long, env = "TOLLGATE_KEEPALIVE_TIMEOUT", default_value = "75s", value_parser = humantime::parse_duration)]
    pub keepalive_timeout: Duration,
    /// How long a write to a client may wait for it to read before its
    /// connection is closed (as NGINX's send_timeout: between two writes,
    /// not for the whole response).
    #[arg(long, env = "TOLLGATE_SEND_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    pub send_timeout: Duration,
    /// How long in-flight requests may finish after SIGTERM.
    #[arg(long, env = "TOLLGATE_SHUTDOWN_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub shutdown_timeout: Duration,
    /// Reload the limits file when it changes (SIGHUP always reloads).
    #[arg(long, env = "TOLLGATE_WATCH_CONFIG", default_value_t = true, action = ArgAction::Set)]
    pub watch_config: bool,
    /// Log format.
    #[arg(long, env = "TOLLGATE_LOG_FORMAT", default_value = "human")]
    pub log_format: LogFormat,
}

/// A listener address, or `off`.
#[derive(Clone, Copy, Debug)]
pub struct Listen(pub Option<SocketAddr>);

/// `--redis-timeout`: at least a millisecond, as no Redis answers sooner
/// (0 made a healthy Redis fail about half the decisions, at random).
fn parse_decision_deadline(text: &str) -> Result<Duration, String> {
    let deadline = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if deadline < Duration::from_millis(1) {
        return Err("must be at least 1ms (a Redis round trip)".into());
    }
    Ok(deadline)
}

/// `--upstream-timeout`: at least a millisecond, as no upstream answers
/// sooner (0 answered a random share of requests to a healthy upstream
/// 504).
fn parse_upstream_timeout(text: &str) -> Result<Duration, String> {
    let timeout = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if timeout < Duration::from_millis(1) {
        return Err("must be at least 1ms (an upstream round trip)".into());
    }
    Ok(timeout)
}

/// Reads a listener address, or `off` (or empty) for none.
pub fn parse_listen(text: &str) -> Result<Listen, String> {
    match text {
        "off" | "" => Ok(Listen(None)),
        _ => text
            .parse()
            .map(|a| Listen(Some(a)))
            .map_err(|e| format!("{e} (or \"off\")")),
    }
}

/// How `--redis` is read.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum RedisModeArg {
    Standalone,
    Cluster,
    Sentinel,
}

/// Whether TLS clients must present a certificate.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ClientAuthArg {
    /// Every client presents one the CA signed.
    Required,
    /// A client may present none; one it presents must verify.
    Optional,
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum LogFormat {
    Human,
    Json,
}
