//! envoyproxy/ratelimit's environment variables, read as tollgate flags, so
//! its deployment manifests work with only the image swapped.
//!
//! A variable counts only when neither the tollgate flag nor its
//! `TOLLGATE_*` variable is given: tollgate's own settings always win.

use std::ffi::OsString;

/// The flags envoyproxy/ratelimit's variables stand for, given `get` to
/// read the environment and `argv` to see which flags are already set.
pub fn flags(get: impl Fn(&str) -> Option<String>, argv: &[OsString]) -> Vec<String> {
    let given = |flag: &str, var: &str| {
        get(var).is_some()
            || argv.iter().any(|a| {
                a.to_str()
                    .is_some_and(|a| a == flag || a.starts_with(&format!("{flag}=")))
            })
    };
    let mut out = Vec::new();
    let mut add = |flag: &str, tollgate_var: &str, value: Option<String>| {
        if let Some(value) = value
            && !given(flag, tollgate_var)
        {
            out.push(flag.to_string());
            out.push(value);
        }
    };
    add("--config", "TOLLGATE_CONFIG", runtime_dir(&get));
    add("--redis", "TOLLGATE_REDIS", redis_urls(&get));
    add(
        "--redis-mode",
        "TOLLGATE_REDIS_MODE",
        get("REDIS_URL").and(get("REDIS_TYPE")).and_then(|t| {
            Some(
                match t.to_ascii_lowercase().as_str() {
                    "single" => "standalone",
                    "cluster" => "cluster",
                    "sentinel" => "sentinel",
                    _ => return None,
                }
                .to_string(),
            )
        }),
    );
    add(
        "--redis-master",
        "TOLLGATE_REDIS_MASTER",
        sentinel(&get).map(|(master, _)| master),
    );
    // Its Sentinels' password, apart from REDIS_AUTH (the master's).
    add(
        "--redis-sentinel-auth",
        "TOLLGATE_REDIS_SENTINEL_AUTH",
        sentinel(&get).and(get("REDIS_SENTINEL_AUTH")).filter(|a| !a.is_empty()),
    );
    add(
        "--grpc-listen",
        "TOLLGATE_GRPC_LISTEN",
        (get("GRPC_PORT").is_some() || get("GRPC_HOST").is_some()).then(|| {
            format!(
                "{}:{}",
                get("GRPC_HOST").unwrap_or_else(|| "0.0.0.0".into()),
                get("GRPC_PORT").unwrap_or_else(|| "8081".into())
            )
        }),
    );
    // Its health check (`/healthcheck`) is on HOST:PORT; so is tollgate's
    // when it runs as a pure rate limit service (no proxy on that port).
    let proxying = given("--upstream", "TOLLGATE_UPSTREAM");
    add(
        "--listen",
        "TOLLGATE_LISTEN",
        get("PORT")
            .filter(|_| !proxying)
            .map(|port| format!("{}:{port}", get("HOST").unwrap_or_else(|| "0.0.0.0".into()))),
    );
    add(
        "--log-format",
        "TOLLGATE_LOG_FORMAT",
        get("LOG_FORMAT").map(|f| {
            if f.eq_ignore_ascii_case("json") {
                "json"
            } else {
                "human"
            }
            .into()
        }),
    );
    // Its booleans, one flag each.
    for (flag, tollgate_var, var) in [
        (
            "--merge-domain-config",
            "TOLLGATE_MERGE_DOMAIN_CONFIG",
            "MERGE_DOMAIN_CONFIG",
        ),
        (
            "--rls-dynamic-metadata",
            "TOLLGATE_RLS_DYNAMIC_METADATA",
            "RESPONSE_DYNAMIC_METADATA",
        ),
        ("--rls-shadow-mode", "TOLLGATE_RLS_SHADOW_MODE", "SHADOW_MODE"),
        ("--rls-quota-mode", "TOLLGATE_RLS_QUOTA_MODE", "QUOTA_MODE"),
        (
            "--rls-headers",
            "TOLLGATE_RLS_HEADERS",
            "LIMIT_RESPONSE_HEADERS_ENABLED",
        ),
    ] {
        add(flag, tollgate_var, boolean(&get, var));
    }
    out
}

/// A setting of its that tollgate cannot honour and must not ignore: a
/// memcache backend would silently become per-instance counters, each
/// replica allowing the whole limit.
pub fn unsupported(get: impl Fn(&str) -> Option<String>) -> Option<String> {
    let backend = get("BACKEND_TYPE")?;
    (!backend.eq_ignore_ascii_case("redis")).then(|| {
        format!(
            "BACKEND_TYPE={backend} is not supported: tollgate shares its counters through Redis \
             (REDIS_URL or --redis) or keeps them in memory for one instance; unset BACKEND_TYPE to choose"
        )
    })
}

/// `RUST_LOG` from its `LOG_LEVEL`, when `RUST_LOG` is not set, or why
/// the `LOG_LEVEL` is refused.
///
/// Its levels are logrus's, which it parses: `warning`, `fatal` and `panic`
/// are levels there. Passed to the log filter as they are, any word but
/// tracing's own five names a log *target* instead, and every line,
/// the one saying why the process cannot start included, went unlogged.
pub fn log_filter(get: impl Fn(&str) -> Option<String>) -> Result<Option<&'static str>, String> {
    if get("RUST_LOG").is_some() {
        return Ok(None);
    }
    let Some(level) = get("LOG_LEVEL") else {
        return Ok(None);
    };
    let filter = match level.to_ascii_lowercase().as_str() {
        // Its level is its own lines': the libraries' trace lines (the file
        // watcher's among them) would flood the log, and feed themselves
        // when the log file lies in the watched directory.
        "trace" => "info,tollgate=trace",
        "debug" => "info,tollgate=debug",
        "info" => "info",
        "warn" | "warning" => "warn",
        // tollgate neither exits nor panics on its own log lines: what
        // these keep is the errors.
        "error" | "fatal" | "panic" => "error",
        _ => {
            return Err(format!(
                "LOG_LEVEL={level} is not a log level: one of trace, debug, info, warn (warning), error, fatal, panic"
            ));
        }
    };
    Ok(Some(filter))
}

/// Its runtime directory: RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY.
fn runtime_dir(get: &impl Fn(&str) -> Option<String>) -> Option<String> {
    let root = get("RUNTIME_ROOT")?;
    let mut path = std::path::PathBuf::from(root);
    if let Some(sub) = get("RUNTIME_SUBDIRECTORY") {
        path.push(sub);
    }
    path.push(get("RUNTIME_APPDIRECTORY").unwrap_or_else(|| "config".into()));
    Some(path.display().to_string())
}

fn boolean(get: &impl Fn(&str) -> Option<String>, var: &str) -> Option<String> {
    get(var).map(|v| matches!(v.to_ascii_lowercase().as_str(), "true" | "1" | "t" | "yes").to_string())
}

/// The master name and addresses of `REDIS_URL` in Sentinel mode
/// (`master,host:port,host:port`).
fn sentinel(get: &impl Fn(&str) -> Option<String>) -> Option<(String, Vec<String>)> {
    let kind = get("REDIS_TYPE")?;
    if !kind.eq_ignore_ascii_case("sentinel") {
        return None;
    }
    let url = get("REDIS_URL")?;
    let mut parts = url.split(',').map(str::trim);
    let master = parts.next()?.to_string();
    Some((master, parts.map(str::to_string).collect()))
}

/// `REDIS_URL` (`host:port`, comma-separated for Cluster and Sentinel, or a
/// socket path with `REDIS_SOCKET_TYPE=unix`) with `REDIS_AUTH`
/// (`password` or `user:password`) and `REDIS_TLS`, as tollgate URLs.
fn redis_urls(get: &impl Fn(&str) -> Option<String>) -> Option<String> {
    let url = get("REDIS_URL")?;
    let hosts: Vec<String> = match sentinel(get) {
        Some((_, hosts)) => hosts,
        None => url.split(',').map(|h| h.trim().to_string()).collect(),
    };
    let credentials = get("REDIS_AUTH")
        .filter(|a| !a.is_empty())
        .map(|a| match a.split_once(':') {
            Some((user, password)) => (Some(user.to_string()), password.to_string()),
            None => (None, a),
        });
    let auth = match &credentials {
        Some((Some(user), password)) => format!("{}:{}@", encode(user), encode(password)),
        Some((None, password)) => format!(":{}@", encode(password)),
        None => String::new(),
    };
    // A socket has no authority part: the credentials go in the query.
    let socket_auth = match &credentials {
        Some((Some(user), password)) => format!("?user={}&pass={}", encode(user), encode(password)),
        Some((None, password)) => format!("?pass={}", encode(password)),
        None => String::new(),
    };
    // Its default socket type is unix; a path says so too.
    let unix = match get("REDIS_SOCKET_TYPE") {
        Some(t) => t.eq_ignore_ascii_case("unix"),
        None => url.starts_with('/'),
    };
    let tls = boolean(get, "REDIS_TLS").as_deref() == Some("true");
    let scheme = if tls { "rediss" } else { "redis" };
    Some(
        hosts
            .iter()
            .map(|h| match unix {
                true => format!("unix://{h}{socket_auth}"),
                false => format!("{scheme}://{auth}{h}"),
            })
            .collect::<Vec<_>>()
            .join(","),
    )
}

/// Percent-encodes what a URL's userinfo or query cannot hold as is.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn from(vars: &[(&str, &str)], argv: &[&str]) -> Vec<String> {
        let vars: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let argv: Vec<OsString> = argv.iter().map(OsString::from).collect();
        flags(|k| vars.get(k).cloned(), &argv)
    }

    #[test]
    fn its_deployment_variables_become_flags() {
        let got = from(
            &[
                ("REDIS_SOCKET_TYPE", "tcp"),
                ("REDIS_URL", "redis:6379"),
                ("REDIS_AUTH", "s3cret"),
                ("RUNTIME_ROOT", "/data"),
                ("RUNTIME_SUBDIRECTORY", "ratelimit"),
                ("GRPC_PORT", "9090"),
                ("USE_STATSD", "false"),
            ],
            &["tollgate"],
        );
        assert_eq!(
            got,
            [
                "--config",
                "/data/ratelimit/config",
                "--redis",
                "redis://:s3cret@redis:6379",
                "--grpc-listen",
                "0.0.0.0:9090"
            ]
        );
    }

    #[test]
    fn sentinel_passwords_stay_apart() {
        let got = from(
            &[
                ("REDIS_TYPE", "SENTINEL"),
                ("REDIS_URL", "mymaster,s1:26379,s2:26379"),
                ("REDIS_AUTH", "master-pw"),
                ("REDIS_SENTINEL_AUTH", "sentinel-pw"),
            ],
            &["tollgate"],
        );
        assert_eq!(
            got,
            [
                "--redis",
                "redis://:master-pw@s1:26379,redis://:master-pw@s2:26379",
                "--redis-mode",
                "sentinel",
                "--redis-master",
                "mymaster",
                "--redis-sentinel-auth",
                "sentinel-pw"
            ]
        );
        // Only with Sentinel, and never over tollgate's own setting.
        let plain = from(&[("REDIS_URL", "r:6379"), ("REDIS_SENTINEL_AUTH", "x")], &["tollgate"]);
        assert!(!plain.contains(&"--redis-sentinel-auth".to_string()));
        let own = from(
            &[
                ("REDIS_TYPE", "SENTINEL"),
                ("REDIS_URL", "m,s:1"),
                ("REDIS_SENTINEL_AUTH", "x"),
                ("TOLLGATE_REDIS_SENTINEL_AUTH", "y"),
            ],
            &["tollgate"],
        );
        assert!(!own.contains(&"--redis-sentinel-auth".to_string()));
    }

    #[test]
    fn log_level_applies_unless_rust_log_is_set() {
        let vars = |v: &'static [(&'static str, &'static str)]| {
            move |k: &str| v.iter().find(|(n, _)| *n == k).map(|(_, x)| x.to_string())
        };
        assert_eq!(
            log_filter(vars(&[("LOG_LEVEL", "DEBUG")])),
            Ok(Some("info,tollgate=debug"))
        );
        assert_eq!(
            log_filter(vars(&[("LOG_LEVEL", "DEBUG"), ("RUST_LOG", "warn")])),
            Ok(None)
        );
        assert_eq!(log_filter(vars(&[])), Ok(None));
    }

    #[test]
    fn every_logrus_level_is_a_level_and_any_other_word_is_refused() {
        let level = |l: &'static str| log_filter(move |k: &str| (k == "LOG_LEVEL").then(|| l.to_string()));
        for (logrus, ours) in [
            ("trace", "info,tollgate=trace"),
            ("debug", "info,tollgate=debug"),
            ("Info", "info"),
            ("warn", "warn"),
            ("warning", "warn"),
            ("WARNING", "warn"),
            ("error", "error"),
            ("fatal", "error"),
            ("panic", "error"),
        ] {
            assert_eq!(level(logrus), Ok(Some(ours)), "{logrus}");
        }
        for word in ["verbose", "nonsense", "tollgate=debug", "off"] {
            assert!(
                level(word).is_err_and(|e| e.contains(word) && e.contains("warning")),
                "{word}"
            );
        }
    }

    #[test]
    fn a_memcache_backend_is_refused_not_ignored() {
        let vars = |v: &'static [(&'static str, &'static str)]| {
            move |k: &str| v.iter().find(|(n, _)| *n == k).map(|(_, x)| x.to_string())
        };
        assert!(unsupported(vars(&[("BACKEND_TYPE", "memcache")])).is_some_and(|m| m.contains("memcache")));
        assert_eq!(unsupported(vars(&[("BACKEND_TYPE", "redis")])), None);
        assert_eq!(unsupported(vars(&[])), None);
    }

    #[test]
    fn tollgate_settings_win() {
        let got = from(
            &[("REDIS_URL", "redis:6379"), ("TOLLGATE_REDIS", "redis://other:1")],
            &["tollgate", "--grpc-listen", "127.0.0.1:1"],
        );
        assert!(got.is_empty(), "{got:?}");
        let got = from(
            &[("GRPC_PORT", "9"), ("RUNTIME_ROOT", "/r")],
            &["tollgate", "--config=/x", "--grpc-listen", "a"],
        );
        assert!(got.is_empty(), "{got:?}");
    }

    #[test]
    fn cluster_sentinel_unix_and_tls() {
        let cluster = from(
            &[
                ("REDIS_TYPE", "CLUSTER"),
                ("REDIS_URL", "a:1,b:2"),
                ("REDIS_TLS", "true"),
                ("REDIS_AUTH", "u:p"),
            ],
            &[],
        );
        assert_eq!(
            cluster,
            [
                "--redis",
                "rediss://u:p@a:1,rediss://u:p@b:2",
                "--redis-mode",
                "cluster"
            ]
        );
        let sentinel = from(
            &[("REDIS_TYPE", "sentinel"), ("REDIS_URL", "mymaster,s1:26379,s2:26379")],
            &[],
        );
        assert_eq!(
            sentinel,
            [
                "--redis",
                "redis://s1:26379,redis://s2:26379",
                "--redis-mode",
                "sentinel",
                "--redis-master",
                "mymaster"
            ]
        );
        let unix = from(
            &[("REDIS_SOCKET_TYPE", "unix"), ("REDIS_URL", "/var/run/redis.sock")],
            &[],
        );
        assert_eq!(unix, ["--redis", "unix:///var/run/redis.sock"]);
        // A socket's password goes in the query (found by a tester: without
        // it every decision failed open).
        let unix = from(&[("REDIS_URL", "/r.sock"), ("REDIS_AUTH", "s3cret/#")], &[]);
        assert_eq!(unix, ["--redis", "unix:///r.sock?pass=s3cret%2F%23"]);
        let tcp = from(&[("REDIS_URL", "r:1"), ("REDIS_AUTH", "u@x:p@ss")], &[]);
        assert_eq!(tcp, ["--redis", "redis://u%40x:p%40ss@r:1"]);
    }
}
