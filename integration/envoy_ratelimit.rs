//! envoyproxy/ratelimit's own tests as the spec for the drop-in promise:
//! its config fixtures with every lookup its config tests make, its
//! integration scenarios, and the configs of its README and examples, ported
//! as data (`fixtures/envoy_ratelimit/`) and run against the real binary as
//! a pure rate limit service, with memory and with Redis counters.

use std::path::{Path, PathBuf};
use std::process::Command;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{Entry, RateLimitOverride};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{UInt64Value, Value as PbValue};
use serde::Deserialize;
use tonic::transport::Channel;

use crate::common::*;

fn fixtures() -> PathBuf {
    repo_file("integration/fixtures/envoy_ratelimit")
}

#[derive(Debug, Deserialize)]
struct ConfigCase {
    test: String,
    files: Vec<String>,
    #[serde(default)]
    merge: bool,
    load: String,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    lookups: Vec<Lookup>,
}

#[derive(Debug, Deserialize)]
struct Lookup {
    domain: String,
    descriptor: Vec<(String, String)>,
    #[serde(default, rename = "override")]
    limit_override: Option<Override>,
    expect: Option<Expect>,
}

#[derive(Debug, Deserialize)]
struct Override {
    requests_per_unit: u32,
    unit: String,
}

#[derive(Debug, Deserialize)]
struct Expect {
    requests_per_unit: u32,
    unit: String,
    name: String,
    unlimited: bool,
    shadow_mode: bool,
    #[serde(default)]
    share_threshold: Option<Vec<String>>,
    #[serde(default)]
    metadata: Option<serde_json::Value>,
}

fn config_cases() -> Vec<ConfigCase> {
    let text = std::fs::read_to_string(fixtures().join("config_cases.yaml")).unwrap();
    yaml_serde::from_str(&text).unwrap()
}

fn unit(name: &str) -> Unit {
    Unit::from_str_name(&name.to_ascii_uppercase()).unwrap_or_else(|| panic!("unit {name}"))
}

fn descriptor(entries: &[(String, String)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(key, value)| Entry {
                key: key.clone(),
                value: value.clone(),
            })
            .collect(),
        ..Default::default()
    }
}

/// A request of one descriptor costing `hits` (0: look, charge nothing).
fn single(domain: &str, mut d: RateLimitDescriptor, hits: u64) -> RateLimitRequest {
    d.hits_addend = Some(UInt64Value { value: hits });
    RateLimitRequest {
        domain: domain.to_string(),
        descriptors: vec![d],
        hits_addend: 0,
    }
}

fn pb_to_json(v: &PbValue) -> serde_json::Value {
    match &v.kind {
        Some(Kind::StringValue(s)) => s.clone().into(),
        Some(Kind::NumberValue(n)) => serde_json::Number::from_f64(*n).map_or(serde_json::Value::Null, Into::into),
        Some(Kind::BoolValue(b)) => (*b).into(),
        Some(Kind::StructValue(s)) => s.fields.iter().map(|(k, v)| (k.clone(), pb_to_json(v))).collect(),
        Some(Kind::ListValue(l)) => l.values.iter().map(pb_to_json).collect(),
        Some(Kind::NullValue(_)) | None => serde_json::Value::Null,
    }
}

/// Numbers compare as numbers, whatever YAML made of them.
fn normalise(v: &serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Number(n) => n.as_f64().into(),
        serde_json::Value::Array(a) => a.iter().map(normalise).collect(),
        serde_json::Value::Object(o) => o.iter().map(|(k, v)| (k.clone(), normalise(v))).collect(),
        other => other.clone(),
    }
}

struct Service {
    _tg: Tollgate,
    client: RateLimitServiceClient<Channel>,
}

impl Service {
    async fn start(files: &[PathBuf], merge: bool, redis: Option<&RedisServer>) -> Service {
        let mut extra = vec!["--rls-dynamic-metadata", "true"];
        if merge {
            extra.extend(["--merge-domain-config", "true"]);
        }
        let url = redis.map(RedisServer::url);
        if let Some(url) = &url {
            extra.extend(["--redis", url.as_str()]);
        }
        let tg = Tollgate::start_rls(files, &extra);
        let client = RateLimitServiceClient::connect(format!("http://{}", tg.grpc.unwrap()))
            .await
            .unwrap();
        Service { _tg: tg, client }
    }

    async fn ask(&mut self, req: RateLimitRequest) -> RateLimitResponse {
        self.client.should_rate_limit(req).await.unwrap().into_inner()
    }

    async fn status(&mut self, req: RateLimitRequest) -> DescriptorStatus {
        self.ask(req).await.statuses.remove(0)
    }
}

/// `tollgate check` over these files: whether they load.
fn check(files: &[PathBuf], merge: bool) -> (bool, String) {
    let mut cmd = Command::new(binary());
    cmd.arg("check");
    for f in files {
        cmd.arg("--config").arg(f);
    }
    if merge {
        cmd.args(["--merge-domain-config", "true"]);
    }
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn paths(dir: &Path, files: &[String]) -> Vec<PathBuf> {
    files.iter().map(|f| dir.join(f)).collect()
}

/// Every config case: the same files load or are refused, and every lookup
/// answers the same limit (requests_per_unit, unit, name), unlimited, or no
/// limit; shadow mode, shared wildcard counters and metadata behave as the
/// reference's limit says.
async fn config_suite(redis: Option<&RedisServer>) {
    let dir = fixtures().join("config");
    let mut failures = Vec::new();
    for case in config_cases() {
        let files = paths(&dir, &case.files);
        let (loads, output) = check(&files, case.merge);
        if case.load == "error" {
            if loads {
                failures.push(format!(
                    "{}: loads, but envoyproxy/ratelimit refuses it ({})",
                    case.test,
                    case.error.as_deref().unwrap_or("")
                ));
            } else if !output.contains(".yaml") {
                failures.push(format!("{}: refused without naming the file: {output}", case.test));
            }
            continue;
        }
        if !loads {
            failures.push(format!(
                "{}: refused, but envoyproxy/ratelimit loads it: {output}",
                case.test
            ));
            continue;
        }
        if let Some(redis) = redis {
            redis.cli(&["FLUSHALL"]);
        }
        let mut rls = Service::start(&files, case.merge, redis).await;
        let mut shared = Vec::new();
        for (i, lookup) in case.lookups.iter().enumerate() {
            let what = format!("{} lookup {i} {:?}", case.test, lookup.descriptor);
            let mut d = descriptor(&lookup.descriptor);
            if let Some(o) = &lookup.limit_override {
                d.limit = Some(RateLimitOverride {
                    requests_per_unit: o.requests_per_unit,
                    unit: unit(&o.unit) as i32,
                });
            }
            let answer = rls.ask(single(&lookup.domain, d.clone(), 0)).await;
            let status = &answer.statuses[0];
            let got_metadata = answer
                .dynamic_metadata
                .as_ref()
                .and_then(|m| m.fields.get("metadata"))
                .map(pb_to_json);
            match &lookup.expect {
                None => {
                    if status.code != Code::Ok as i32
                        || status.current_limit.is_some()
                        || status.limit_remaining == u32::MAX
                    {
                        failures.push(format!("{what}: expected no limit, got {status:?}"));
                    }
                }
                Some(e) if e.unlimited => {
                    if status.code != Code::Ok as i32 || status.limit_remaining != u32::MAX {
                        failures.push(format!("{what}: expected unlimited, got {status:?}"));
                    }
                }
                Some(e) => {
                    let limit = status.current_limit.as_ref();
                    let seen = limit.map(|l| (l.requests_per_unit, l.unit, l.name.as_str()));
                    let wanted = (e.requests_per_unit, unit(&e.unit) as i32, e.name.as_str());
                    if seen != Some(wanted) || status.limit_remaining != e.requests_per_unit {
                        failures.push(format!(
                            "{what}: expected {wanted:?} with all of it left, got {status:?}"
                        ));
                    }
                    if got_metadata.as_ref().map(normalise) != e.metadata.as_ref().map(normalise) {
                        failures.push(format!(
                            "{what}: dynamic metadata {got_metadata:?}, expected {:?}",
                            e.metadata
                        ));
                    }
                    if lookup.limit_override.is_none() {
                        // A cost past the whole limit: over, charged nowhere;
                        // a shadow limit still answers OK.
                        let over = rls
                            .status(single(&lookup.domain, d.clone(), u64::from(e.requests_per_unit) + 1))
                            .await;
                        let code = if e.shadow_mode { Code::Ok } else { Code::OverLimit };
                        if over.code != code as i32 {
                            failures.push(format!("{what}: over the limit answers {over:?}, expected {code:?}"));
                        }
                    }
                    if let Some(patterns) = &e.share_threshold
                        && e.requests_per_unit > 0
                    {
                        shared.push((lookup, patterns.clone(), what.clone()));
                    }
                }
            }
        }
        // Charging a value a share_threshold wildcard matched takes from the
        // one counter every such value shares: the one the pattern itself,
        // sent as the value, names.
        for (lookup, patterns, what) in shared {
            let pattern_entries: Vec<(String, String)> = lookup
                .descriptor
                .iter()
                .zip(patterns.iter().chain(std::iter::repeat(&String::new())))
                .map(|((k, v), p)| (k.clone(), if p.is_empty() { v.clone() } else { p.clone() }))
                .collect();
            let before = rls
                .status(single(&lookup.domain, descriptor(&pattern_entries), 0))
                .await
                .limit_remaining;
            let charged = rls
                .status(single(&lookup.domain, descriptor(&lookup.descriptor), 1))
                .await;
            let after = rls
                .status(single(&lookup.domain, descriptor(&pattern_entries), 0))
                .await
                .limit_remaining;
            if charged.code == Code::Ok as i32 && after.checked_add(1) != Some(before) {
                failures.push(format!(
                    "{what}: charging did not take from the shared counter ({before} -> {after})"
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} differences:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reference_config_suite_with_memory_counters() {
    config_suite(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reference_config_suite_with_redis_counters() {
    let redis = RedisServer::start();
    config_suite(Some(&redis)).await;
}

/// Not in the reference's suite, but what its code does: quota limits
/// refuse only together, and with metadata answered for passed limits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_mode_refuses_only_when_every_quota_limit_is_over() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("quota.yaml");
    std::fs::write(
        &file,
        "domain: q
descriptors:
  - key: user
    quota_mode: true
    rate_limit: { unit: hour, requests_per_unit: 2 }
  - key: org
    quota_mode: true
    rate_limit: { unit: hour, requests_per_unit: 4 }
  - key: ip
    rate_limit: { unit: hour, requests_per_unit: 5 }
",
    )
    .unwrap();
    for redis in [None, Some(RedisServer::start())] {
        let mut rls = Service::start(std::slice::from_ref(&file), false, redis.as_ref()).await;
        let request = || RateLimitRequest {
            domain: "q".into(),
            descriptors: [("user", "u"), ("org", "o"), ("ip", "i")]
                .iter()
                .map(|(k, v)| descriptor(&[(k.to_string(), v.to_string())]))
                .collect(),
            hits_addend: 0,
        };
        let mut codes = Vec::new();
        for _ in 0..6 {
            let r = rls.ask(request()).await;
            codes.push((r.overall_code, r.statuses[0].code, r.statuses[1].code));
        }
        let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
        assert_eq!(
            codes,
            vec![
                (ok, ok, ok),
                (ok, ok, ok),
                // The user quota is spent, the org quota is not: admitted.
                (ok, over, ok),
                (ok, over, ok),
                // Both quotas spent: refused.
                (over, over, over),
                (over, over, over),
            ]
        );
        // The refused requests charged nothing: the ip limit has 1 left.
        let r = rls.ask(single("q", descriptor(&[("ip".into(), "i".into())]), 0)).await;
        assert_eq!(r.statuses[0].limit_remaining, 1);
    }
}
