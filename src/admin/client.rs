//! `tollgate explain`: asks a running instance's admin listener the page's
//! dry-run question (`POST /api/explain`) and prints the answer for a
//! terminal.

use std::fmt::Write;

use bytes::Bytes;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{Value as Json, json};

use crate::settings::ExplainArgs;

/// Why the question got no answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// An argument cannot be sent as given.
    #[error("{0}")]
    Args(String),
    /// The admin listener could not be reached or failed mid-answer.
    #[error("cannot ask {0}: {1}")]
    Unreachable(String, String),
    /// It answered with an error.
    #[error("{0}")]
    Refused(String),
}

/// The question `args` describe, as `/api/explain` takes it.
pub fn question(args: &ExplainArgs) -> Result<Json, ClientError> {
    if let Some(domain) = &args.domain {
        let descriptors = args
            .descriptors
            .iter()
            .map(|d| {
                let entries = d
                    .split(',')
                    .map(|e| {
                        let (k, v) = e
                            .split_once('=')
                            .ok_or_else(|| ClientError::Args(format!("descriptor entry {e:?} is not key=value")))?;
                        Ok(json!([k.trim(), v.trim()]))
                    })
                    .collect::<Result<Vec<_>, ClientError>>()?;
                Ok(json!({"entries": entries, "hits_addend": args.hits_addend}))
            })
            .collect::<Result<Vec<_>, ClientError>>()?;
        return Ok(json!({"domain": domain, "descriptors": descriptors}));
    }
    let headers = args
        .headers
        .iter()
        .map(|h| {
            let (name, value) = h
                .split_once(':')
                .ok_or_else(|| ClientError::Args(format!("header {h:?} is not Name: value")))?;
            Ok(json!([name.trim(), value.trim()]))
        })
        .collect::<Result<Vec<_>, ClientError>>()?;
    Ok(json!({
        "method": args.method,
        "path": args.path,
        "host": args.host,
        "headers": headers,
        "client": args.client,
    }))
}

/// Longest wait for the admin listener's answer.
const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Sends the question to the admin listener and returns its JSON answer
/// (within [`ANSWER_TIMEOUT`]).
pub async fn ask(args: &ExplainArgs) -> Result<Json, ClientError> {
    match tokio::time::timeout(ANSWER_TIMEOUT, ask_once(args)).await {
        Ok(answer) => answer,
        Err(_) => Err(ClientError::Unreachable(
            args.admin.clone(),
            format!("no answer within {ANSWER_TIMEOUT:?}"),
        )),
    }
}

async fn ask_once(args: &ExplainArgs) -> Result<Json, ClientError> {
    let body = serde_json::to_vec(&question(args)?).map_err(|e| ClientError::Args(e.to_string()))?;
    let unreachable = |e: &dyn std::fmt::Display| ClientError::Unreachable(args.admin.clone(), e.to_string());
    let stream = tokio::net::TcpStream::connect(args.admin.as_str())
        .await
        .map_err(|e| unreachable(&e))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| unreachable(&e))?;
    tokio::spawn(conn);
    let mut req = Request::post("/api/explain")
        .header(header::HOST, args.admin.as_str())
        .header(header::CONTENT_TYPE, "application/json");
    // An empty one (an unset template variable) is none: the server
    // refuses to start with it.
    if let Some(token) = args.admin_token.as_deref().filter(|t| !t.is_empty()) {
        req = req.header(header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let req = req
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| ClientError::Args(e.to_string()))?;
    let response = sender.send_request(req).await.map_err(|e| unreachable(&e))?;
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|e| unreachable(&e))?
        .to_bytes();
    let answer: Option<Json> = serde_json::from_slice(&bytes).ok();
    match (status, answer) {
        (StatusCode::OK, Some(answer)) => Ok(answer),
        (_, Some(answer)) if answer.get("error").is_some() => Err(ClientError::Refused(
            answer
                .get("error")
                .and_then(Json::as_str)
                .unwrap_or_default()
                .to_owned(),
        )),
        (status, _) => Err(ClientError::Refused(format!(
            "the admin listener answered {status}: {}",
            String::from_utf8_lossy(&bytes).trim()
        ))),
    }
}

/// The answer, for a terminal.
pub fn render(args: &ExplainArgs, answer: &Json) -> String {
    let s = |v: &Json, k: &str| v.get(k).and_then(Json::as_str).unwrap_or_default().to_owned();
    let n = |v: &Json, k: &str| v.get(k).and_then(Json::as_u64);
    let mut out = String::new();
    let asked = match &args.domain {
        Some(d) => format!("domain {d}, {} descriptor(s)", args.descriptors.len()),
        None => format!("{} {} from {}", args.method, args.path, args.client),
    };
    let _ = write!(out, "{asked}: {}", s(answer, "verdict").replace('_', " "));
    if let Some(status) = n(answer, "status") {
        let _ = write!(out, ", status {status}");
    }
    if let Some(ms) = n(answer, "retry_after_ms") {
        let _ = write!(out, ", retry after {}", seconds(ms));
    }
    out.push_str(" (dry run: nothing charged)\n");
    if let Some(e) = answer.get("store_error").and_then(Json::as_str) {
        let _ = writeln!(out, "counter store: {e}");
    }
    if answer.get("from_denial_cache").and_then(Json::as_bool) == Some(true) {
        out.push_str("answered from the denial cache: it knows what is left, not the count\n");
    }
    if let Some(note) = answer.get("note").and_then(Json::as_str) {
        let _ = writeln!(out, "{note}");
    }
    let rules = answer
        .get("rules")
        .and_then(Json::as_array)
        .cloned()
        .unwrap_or_default();
    if rules.is_empty() {
        out.push_str("no rule matches\n");
    }
    for rule in &rules {
        let values: Vec<String> = rule
            .get("values")
            .and_then(Json::as_array)
            .map(|v| v.iter().map(value_text).collect())
            .unwrap_or_default();
        let counter = match values.is_empty() {
            true => "one shared counter".to_owned(),
            false => format!("counter {}", values.join(", ")),
        };
        let _ = write!(
            out,
            "rule {} ({counter}), cost {}",
            s(rule, "rule"),
            n(rule, "cost").unwrap_or(1)
        );
        if rule.get("shadow").and_then(Json::as_bool) == Some(true) {
            out.push_str(", shadow");
        }
        if rule.get("would_refuse").and_then(Json::as_bool) == Some(true) {
            out.push_str(": would refuse");
        }
        out.push('\n');
        for w in rule.get("windows").and_then(Json::as_array).into_iter().flatten() {
            // The denial cache knows no count: "used ?" rather than a 0
            // it did not see.
            let used = n(w, "used").map_or_else(|| "?".to_owned(), |u| u.to_string());
            let _ = write!(
                out,
                "  {}: used {used}/{}, remaining {}, resets in {}",
                s(w, "window"),
                n(w, "limit").unwrap_or(0),
                n(w, "remaining").unwrap_or(0),
                seconds(n(w, "reset_ms").unwrap_or(0)),
            );
            if w.get("never").and_then(Json::as_bool) == Some(true) {
                out.push_str(", never fits (cost above the limit)");
            } else if let Some(ms) = n(w, "retry_ms") {
                let _ = write!(out, ", retry in {}", seconds(ms));
            }
            out.push('\n');
        }
    }
    out
}

/// A counter value for a terminal: control characters escaped (a caller's
/// value must not move the cursor or colour the screen), a hashed value
/// said to be one.
fn value_text(v: &Json) -> String {
    match v {
        Json::String(s) => s
            .chars()
            .flat_map(|c| match c.is_control() {
                true => c.escape_default().collect::<Vec<_>>(),
                false => vec![c],
            })
            .collect(),
        other => format!(
            "{}(hashed, {} bytes: {}…)",
            other
                .get("key")
                .and_then(Json::as_str)
                .map(|k| format!("{k}="))
                .unwrap_or_default(),
            other.get("bytes").and_then(Json::as_u64).unwrap_or(0),
            other.get("sha256").and_then(Json::as_str).unwrap_or_default(),
        ),
    }
}

fn seconds(ms: u64) -> String {
    format!("{:.1} s", ms as f64 / 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(argv: &[&str]) -> ExplainArgs {
        let cli = crate::settings::Cli::parse_from(std::iter::once("tollgate").chain(argv.iter().copied()));
        match cli.command {
            Some(crate::settings::Command::Explain(a)) => *a,
            _ => panic!("not parsed as explain: {argv:?}"),
        }
    }

    #[test]
    fn flags_become_the_question() {
        let a = args(&[
            "explain",
            "-X",
            "POST",
            "-H",
            "X-Api-Key: k1",
            "--client",
            "10.0.0.1",
            "/login?x=1",
        ]);
        let q = question(&a).unwrap();
        assert_eq!(q["method"], "POST");
        assert_eq!(q["path"], "/login?x=1");
        assert_eq!(q["headers"][0], json!(["X-Api-Key", "k1"]));
        let a = args(&[
            "explain",
            "--domain",
            "edge",
            "--descriptor",
            "remote_address=10.0.0.1,path=/x",
        ]);
        let q = question(&a).unwrap();
        assert_eq!(q["descriptors"][0]["entries"][1], json!(["path", "/x"]));
        assert!(question(&args(&["explain", "-H", "no colon"])).is_err());
    }
}
