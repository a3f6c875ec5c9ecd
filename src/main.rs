//! The `tollgate` command: flags in, signals in, exit status out. All
//! behaviour lives in the library ([`tollgate::server`] runs it).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use tollgate::reload::LiveFiles;
use tollgate::server::Server;
use tollgate::settings::{Cli, Command, LogFormat};

// Many small short-lived allocations per request (headers, keys); glibc's
// allocator showed up at ~5% of proxy CPU in profiles, mimalloc much less.
#[global_allocator]
static ALLOCATOR: tollgate::heap::Allocator = tollgate::heap::Allocator;

fn main() -> ExitCode {
    tollgate::heap::no_transparent_huge_pages();
    tollgate::heap::purge_free_pages_sooner();
    let get = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if !matches!(argv.get(1).and_then(|a| a.to_str()), Some("check" | "explain")) {
        // envoyproxy/ratelimit's environment, read as our flags.
        if let Some(problem) = tollgate::ratelimit_env::unsupported(get) {
            eprintln!("tollgate: {problem}");
            return ExitCode::FAILURE;
        }
        let extra = tollgate::ratelimit_env::flags(get, &argv);
        argv.extend(extra.into_iter().map(Into::into));
    }
    let cli = Cli::parse_from(argv);
    if let Some(Command::Check {
        config,
        merge_domain_config,
    }) = cli.command
    {
        return check(&config, merge_domain_config);
    }
    if let Some(Command::Explain(args)) = cli.command {
        return explain(&args);
    }
    if let Err(problem) = init_logging(cli.run.log_format) {
        eprintln!("tollgate: {problem}");
        return ExitCode::FAILURE;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tollgate: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        // Installed before any listener is bound: once a port answers, a
        // SIGHUP must mean "reload", never the default action (exit).
        let signals = Signals::install();
        match Server::start(cli.run).await {
            Ok(server) => {
                signals.serve_until_stopped(&server).await;
                server.stop().await;
                ExitCode::SUCCESS
            }
            Err(e) => {
                tracing::error!("{e}");
                ExitCode::FAILURE
            }
        }
    })
}

/// `tollgate check`: loads the files as start-up would, and says why not.
fn check(paths: &[PathBuf], merge: bool) -> ExitCode {
    match LiveFiles::load(paths, merge) {
        Ok(files) => {
            for f in files.files().iter() {
                let (limits, file) = (f.active().load(), f.status().file.clone());
                let n = limits.rules.len();
                let rules = if n == 1 { "rule" } else { "rules" };
                println!("{file}: ok (domain {}, {n} {rules})", limits.domain);
                for warning in tollgate::config::warnings(&limits) {
                    eprintln!("{file}: warning: {warning}");
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

/// `tollgate explain`: asks a running instance, prints its answer.
fn explain(args: &tollgate::settings::ExplainArgs) -> ExitCode {
    use tollgate::admin::client;
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tollgate: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(client::ask(args)) {
        Ok(answer) if args.json => {
            println!("{answer:#}");
            ExitCode::SUCCESS
        }
        Ok(answer) => {
            print!("{}", client::render(args, &answer));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tollgate explain: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Sets up the log, or says why its filter is refused: a filter that
/// cannot be read would leave the process running with no log at all.
fn init_logging(format: LogFormat) -> Result<(), String> {
    let get = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let filter = match get("RUST_LOG") {
        Some(directives) => tracing_subscriber::EnvFilter::try_new(&directives)
            .map_err(|e| format!("RUST_LOG={directives} is not a log filter: {e}"))?,
        None => tracing_subscriber::EnvFilter::new(tollgate::ratelimit_env::log_filter(get)?.unwrap_or("info")),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    Ok(())
}

/// The process's signal handlers: SIGTERM/SIGINT stop, SIGHUP reloads.
struct Signals(Option<[tokio::signal::unix::Signal; 3]>);

impl Signals {
    fn install() -> Self {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
            signal(SignalKind::hangup()),
        ) {
            (Ok(term), Ok(int), Ok(hup)) => Self(Some([term, int, hup])),
            _ => {
                tracing::warn!("cannot install signal handlers; stop with SIGKILL");
                Self(None)
            }
        }
    }

    /// Waits for SIGTERM or SIGINT, reloading the limits on every SIGHUP.
    async fn serve_until_stopped(self, server: &Server) {
        let Some([mut term, mut int, mut hup]) = self.0 else {
            std::future::pending::<()>().await;
            return;
        };
        loop {
            tokio::select! {
                _ = term.recv() => return,
                _ = int.recv() => return,
                _ = hup.recv() => {
                    tokio::spawn(server.reload("SIGHUP"));
                }
            }
        }
    }
}
