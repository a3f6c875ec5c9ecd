//! The command line: `tollgate check` and start-up refusals.

use std::process::Command;

use crate::common::binary;

#[test]
fn check_accepts_the_examples_and_names_file_line_and_reason() {
    let ok = Command::new(binary())
        .args(["check", "--config", "conf/limits.yaml"])
        .output()
        .unwrap();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    assert!(String::from_utf8_lossy(&ok.stdout).contains("ok"));

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("limits.yaml");
    std::fs::write(
        &bad,
        "domain: api\nrules:\n  - name: a\n    limits:\n      - { requests: 5, per: 3 parsecs }\n",
    )
    .unwrap();
    let out = Command::new(binary())
        .args(["check", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with(&format!("{}:5: ", bad.display())), "{err}");
    assert!(err.contains("is not a duration"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one clear line: {err}");
}

#[test]
fn an_invalid_file_at_start_up_is_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("limits.json");
    std::fs::write(
        &bad,
        r#"{"domain": "api", "rules": [{"name": "a", "limits": [], "colour": 1}]}"#,
    )
    .unwrap();
    let out = Command::new(binary())
        .args([
            "--upstream",
            "http://127.0.0.1:9",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .arg("--config")
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("limits.json:1:") && err.contains("unknown field `colour`"),
        "{err}"
    );
}

#[test]
fn every_flag_has_an_environment_variable() {
    let out = Command::new(binary()).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--config",
        "--upstream",
        "--listen",
        "--admin-listen",
        "--redis",
        "--redis-timeout",
    ] {
        assert!(help.contains(flag), "{flag}");
    }
    let flags = help
        .lines()
        .filter(|l| l.trim_start().starts_with("--") && !l.contains("--help") && !l.contains("--version"));
    for line in flags {
        let name = line.trim_start().split([' ', '=', '<']).next().unwrap();
        let var = format!(
            "TOLLGATE_{}",
            name.trim_start_matches("--").replace('-', "_").to_uppercase()
        );
        assert!(help.contains(&format!("[env: {var}")), "{name} has no {var}");
    }
}

/// The address tollgate picks for its RLS listener with these arguments:
/// from the "listening" line, or from the error if the port is taken.
fn default_grpc_address(extra: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let limits = dir.path().join("l.yaml");
    std::fs::write(&limits, "domain: d\nrules: []\n").unwrap();
    let mut child = Command::new(binary())
        .args(["--config", limits.to_str().unwrap(), "--admin-listen", "127.0.0.1:0"])
        .args(extra)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut found = String::new();
    for line in std::io::BufRead::lines(stderr).map_while(Result::ok) {
        if let Some(at) = line.find("grpc=") {
            found = line[at + 5..].split_whitespace().next().unwrap_or("").to_string();
            break;
        }
        if let Some(at) = line.find("cannot listen on ") {
            found = line[at + 17..].split_whitespace().next().unwrap_or("").to_string();
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    found
}

#[test]
fn only_the_proxy_listens_beyond_loopback_by_default() {
    // Beside a proxy, whoever reaches the RLS port can charge any caller's
    // counters with descriptors of their choosing: loopback unless asked.
    let beside = default_grpc_address(&["--upstream", "http://127.0.0.1:9", "--listen", "127.0.0.1:0"]);
    assert_eq!(beside, "127.0.0.1:8081");
    // As a pure rate limit service (no --upstream) it is the service, and
    // listens where envoyproxy/ratelimit does.
    assert_eq!(default_grpc_address(&["--listen", "127.0.0.1:0"]), "0.0.0.0:8081");
    let out = Command::new(binary()).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("[default: 127.0.0.1:9901]"),
        "admin stays on loopback: {help}"
    );
}

#[test]
fn check_warns_about_statuses_a_decision_surface_cannot_carry() {
    let out = Command::new(binary())
        .args(["check", "--config", "conf/limits.yaml"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    // The shipped exports rule answers 503 and fails closed.
    assert!(
        err.contains("warning: rule \"exports\": status 503 is sent as 403"),
        "{err}"
    );
    assert!(err.contains("failing closed is 503 on the proxy"), "{err}");
    assert!(!err.contains("\"login\""), "a 429 rule carries everywhere: {err}");
    // The per-key rules sit behind the api-client rule: no flood warning.
    assert!(!err.contains("caller chooses"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let bare = dir.path().join("bare.yaml");
    std::fs::write(
        &bare,
        "domain: d\nrules:\n  - name: per-key\n    by: [\"header:x-key\"]\n    limits: [{ requests: 100, per: 1h }]\n",
    )
    .unwrap();
    let out = Command::new(binary())
        .args(["check", "--config", bare.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success()
            && err
                .contains("rule \"per-key\" keys only on values the caller chooses (header:x-key) over a 3600s window"),
        "{err}"
    );
}

#[test]
fn check_reports_rules_that_can_never_match() {
    let dir = tempfile::tempdir().unwrap();
    let http = dir.path().join("http.yaml");
    std::fs::write(
        &http,
        "domain: d\nrules:\n  - { name: v1, match: { path: '/api//v1*' }, by: [client_ip], limits: [{ requests: 1, per: 1s }] }\n  - { name: fine, match: { path: '/api/v1*' }, by: [client_ip], limits: [{ requests: 1, per: 1s }] }\n",
    )
    .unwrap();
    let envoy = dir.path().join("envoy.yaml");
    std::fs::write(
        &envoy,
        "domain: e\ndescriptors:\n  - key: path\n    value: 'foo*'\n    rate_limit: { unit: second, requests_per_unit: 1 }\n  - key: path\n    value: 'foobar*'\n    rate_limit: { unit: second, requests_per_unit: 2 }\n",
    )
    .unwrap();
    let out = Command::new(binary())
        .args([
            "check",
            "--config",
            http.to_str().unwrap(),
            "--config",
            envoy.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // Warnings, not errors: the files load as they are.
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("http.yaml: warning: rule \"v1\" never matches") && err.contains("write \"/api/v1*\""),
        "{err}"
    );
    assert!(!err.contains("\"fine\""), "{err}");
    assert!(
        err.contains("envoy.yaml: warning: descriptor path_foobar* is shadowed: the wildcard \"path_foo*\""),
        "{err}"
    );
}

/// The 43rd attack: `TOLLGATE_ADMIN_TOKEN=` (a deploy template's unset
/// variable) turned the token check on with a token no client can send:
/// every admin answer 401, `/metrics` included, and nothing said why. The
/// 44th: so did a token of spaces, edged with them, or not ASCII; and
/// refusing the empty one in the command line's parser broke `check` and
/// `explain` run with that environment.
#[test]
fn an_admin_token_no_client_could_send_is_refused_at_start() {
    let start = |flag: Option<&str>, env: Option<&str>| {
        let mut cmd = Command::new(binary());
        cmd.args(["--config", "conf/limits.yaml", "--upstream", "http://127.0.0.1:9"])
            .args([
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--grpc-listen",
                "off",
            ])
            .stderr(std::process::Stdio::piped());
        if let Some(v) = flag {
            cmd.args(["--admin-token", v]);
        }
        if let Some(v) = env {
            cmd.env("TOLLGATE_ADMIN_TOKEN", v);
        }
        // Started, it runs on: 5 s to refuse, then it is taken as started.
        let mut child = cmd.spawn().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                child.kill().unwrap();
                let _ = child.wait();
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        assert!(!out.status.success());
        Some(String::from_utf8_lossy(&out.stderr).into_owned())
    };
    for (flag, env, why) in [
        (Some(""), None, "is empty"),
        (None, Some(""), "is empty"),
        (Some(" "), None, "begins or ends with a space"),
        (None, Some("\t"), "begins or ends with a space"),
        (Some(" s3cret"), None, "begins or ends with a space"),
        (Some("ünï©ødé"), None, "other than visible ASCII"),
    ] {
        let err = start(flag, env).unwrap_or_else(|| panic!("started with {flag:?} / {env:?}"));
        assert!(
            err.contains("--admin-token (TOLLGATE_ADMIN_TOKEN) ") && err.contains(why),
            "{err}"
        );
        assert_eq!(
            err.lines().filter(|l| !l.trim().is_empty()).count(),
            1,
            "one clear line: {err}"
        );
    }
    assert_eq!(
        start(Some("a b"), None),
        None,
        "a token with a space inside can be sent"
    );
    // The same environment does not stop the commands that are no server.
    let check = Command::new(binary())
        .args(["check", "--config", "conf/limits.yaml"])
        .env("TOLLGATE_ADMIN_TOKEN", "")
        .output()
        .unwrap();
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));
    let explain = Command::new(binary())
        .args(["explain", "--admin", "127.0.0.1:9", "/"])
        .env("TOLLGATE_ADMIN_TOKEN", "")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&explain.stderr);
    assert!(
        !err.contains("--admin-token"),
        "asked the server, not refused for its token: {err}"
    );
}

#[test]
fn an_upstream_no_request_could_name_is_refused_at_start() {
    // The 41st attack: these started, and then every request was a 502
    // with a warning line each.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("limits.yaml");
    std::fs::write(&config, "domain: d\nrules: []\n").unwrap();
    let config = config.to_str().unwrap();
    for url in [
        "http://127.0.0.1,x:18100",
        "http://u:p@127.0.0.1:18100",
        "http://127.0.0.1:18100?x=1",
    ] {
        let err = refused_at_start(&["--config", config, "--upstream", url]);
        assert!(err.contains("must look like http://host:port"), "{url}: {err}");
        assert_eq!(
            err.lines().filter(|l| !l.trim().is_empty()).count(),
            1,
            "one clear line: {err}"
        );
    }
}

#[test]
fn a_decision_deadline_or_upstream_timeout_under_a_millisecond_is_refused() {
    // From the twelfth attack: 0s was taken, and a healthy Redis then
    // failed about half the decisions at random. From the fortieth: an
    // upstream timeout of 0 answered a random share of GETs to a healthy
    // upstream 504.
    for (flag, deadline) in [
        ("--redis-timeout", "0s"),
        ("--redis-timeout", "1us"),
        ("--upstream-timeout", "0s"),
        ("--upstream-timeout", "999us"),
    ] {
        let err = refused_at_start(&[flag, deadline]);
        assert!(err.contains(flag) && err.contains("at least 1ms"), "{err}");
    }
}

/// What tollgate says on stderr when `args` (listeners on free ports
/// added) keep it from starting; fails the test if it starts.
fn refused_at_start(args: &[&str]) -> String {
    let out = Command::new(binary())
        .args(args)
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?} started: {err}");
    err
}

/// A second tollgate started on a proxy port another one listens on stops
/// with the reason, as NGINX does: joined to it by `SO_REUSEPORT`, the two
/// would deal the connections between them and, on the memory store, each
/// count its share apart (the 48th attack had 10 of "5 per 60s" through).
#[test]
fn a_second_tollgate_on_a_proxy_port_in_use_is_refused() {
    let limits = "domain: one\nrules:\n  - name: one\n    limits: [{ requests: 5, per: 60s }]\n";
    let first = crate::common::Tollgate::start(limits, "127.0.0.1:9".parse().unwrap(), &[]);
    let mut second = Command::new(binary())
        .args(["--config", "conf/limits.yaml", "--upstream", "http://127.0.0.1:9"])
        .args(["--listen", &first.addr.to_string()])
        .args(["--admin-listen", "127.0.0.1:0", "--grpc-listen", "off"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while second.try_wait().unwrap().is_none() && started.elapsed() < std::time::Duration::from_secs(5) {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = second.kill();
    let out = second.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code().is_some_and(|c| c != 0),
        "started beside the first ({:?}): {err}",
        out.status
    );
    assert!(
        err.contains(&format!("cannot listen on {}", first.addr)) && err.contains("another process listens there"),
        "{err}"
    );
    // The first still answers, alone on its port.
    let statuses: Vec<u16> = (0..7)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(first.addr).unwrap();
            std::io::Write::write_all(&mut s, b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").unwrap();
            let mut answer = String::new();
            std::io::Read::read_to_string(&mut s, &mut answer).unwrap();
            answer.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0)
        })
        .collect();
    assert_eq!(statuses, [502, 502, 502, 502, 502, 429, 429]);
}

#[test]
fn check_counts_one_rule_as_one_rule() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("one.yaml");
    std::fs::write(
        &file,
        "domain: a\nrules:\n  - name: a\n    limits: [{ requests: 1, per: 1s }]\n",
    )
    .unwrap();
    let out = Command::new(binary())
        .arg("check")
        .arg("--config")
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("{}: ok (domain a, 1 rule)\n", file.display())
    );
}
