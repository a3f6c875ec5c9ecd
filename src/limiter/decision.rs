//! What the limiter decided about one request, in the terms surfaces render:
//! the [`Verdict`], and per rule and window what is left, when it frees up
//! and when a refused caller may retry.

use std::sync::Arc;

use crate::config::Rule;
use crate::config::Window;
use crate::metrics;

/// One rule's counter touched by a request.
#[derive(Debug, Clone)]
pub struct Hit {
    /// The rule whose windows apply.
    pub rule: Arc<Rule>,
    /// The counter key (domain, rule and descriptor values).
    pub key: String,
    /// Units this request costs.
    pub cost: u64,
}

/// The overall answer for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Every enforcing rule had room; counters were charged.
    Allowed,
    /// At least one enforcing rule had no room; nothing was charged.
    Limited,
    /// The store failed and every touched rule fails open.
    FailedOpen,
    /// The store failed and a touched rule fails closed.
    FailedClosed,
}

impl From<Verdict> for metrics::Answer {
    fn from(v: Verdict) -> Self {
        match v {
            Verdict::Allowed => metrics::Answer::Allowed,
            Verdict::Limited => metrics::Answer::Limited,
            Verdict::FailedOpen => metrics::Answer::FailedOpen,
            Verdict::FailedClosed => metrics::Answer::FailedClosed,
        }
    }
}

impl Verdict {
    /// Whether the request goes through.
    pub fn admits(self) -> bool {
        matches!(self, Verdict::Allowed | Verdict::FailedOpen)
    }
}

/// One window of one rule, as the caller should see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowOutcome {
    /// The window (limit and length).
    pub window: Window,
    /// Units left in the window after this decision.
    pub remaining: u64,
    /// Milliseconds until more quota frees up.
    pub reset_ms: u64,
    /// Milliseconds until a request of this cost fits, when it does not now.
    pub retry_ms: Option<u64>,
    /// The request asks more of this window than its whole limit.
    pub never: bool,
    /// What is left in the window is not known: the store could not be
    /// asked (a cost above the whole limit is refused without it). No
    /// RateLimit item or remaining count is told for it.
    pub unknown: bool,
}

impl WindowOutcome {
    /// Whether this window refused the request.
    pub fn over(&self) -> bool {
        self.never || self.retry_ms.is_some()
    }
}

impl RuleOutcome {
    /// The window a status names: when the rule refused, the refusing one
    /// that holds the request out longest (it fits only once that one has
    /// room); otherwise the one with the least room left. Ties go to the
    /// one that frees up last.
    pub fn telling_window(&self) -> Option<&WindowOutcome> {
        if self.over {
            self.windows
                .iter()
                .filter(|w| w.over())
                .max_by_key(|w| (w.never, w.retry_ms, std::cmp::Reverse(w.remaining), w.reset_ms))
        } else {
            self.windows
                .iter()
                .min_by_key(|w| (w.remaining, std::cmp::Reverse(w.reset_ms)))
        }
    }
}

/// What one rule said about the request.
#[derive(Debug, Clone)]
pub struct RuleOutcome {
    /// The rule.
    pub rule: Arc<Rule>,
    /// Whether some window had no room (for a shadow rule: would have refused).
    pub over: bool,
    /// Whether the request was counted against this rule.
    pub charged: bool,
    /// Per window, in the rule's order; empty when the store failed.
    pub windows: Vec<WindowOutcome>,
}

/// The decision for one request.
#[derive(Debug, Clone)]
pub struct Decision {
    /// Admit or refuse, and why.
    pub verdict: Verdict,
    /// One entry per hit, in the order given.
    pub rules: Vec<RuleOutcome>,
}

impl Decision {
    /// The enforcing rules that refused the request. Quota rules refuse
    /// only together: when none of them had room.
    pub fn refusing(&self) -> impl Iterator<Item = &RuleOutcome> {
        let quotas_refuse = self.rules.iter().filter(|r| r.rule.quota).all(|r| r.over && !r.rule.shadow);
        self.rules
            .iter()
            .filter(move |r| r.over && !r.rule.shadow && (quotas_refuse || !r.rule.quota))
    }

    /// Milliseconds until a retry of this request would be admitted: the
    /// latest of the refusing windows, since it needs room in all of them,
    /// but for quota rules the earliest of them, since one with room is
    /// enough. `None` when it was not refused, or when it can never be
    /// admitted as sent (it costs more than a window's whole limit).
    pub fn retry_after_ms(&self) -> Option<u64> {
        if self.never_fits() {
            return None;
        }
        let rule_retry = |r: &RuleOutcome| r.windows.iter().filter_map(|w| w.retry_ms).max();
        let enforced = self.refusing().filter(|r| !r.rule.quota).filter_map(rule_retry).max();
        let quota = self
            .refusing()
            .filter(|r| r.rule.quota && !r.windows.iter().any(|w| w.never))
            .filter_map(rule_retry)
            .min();
        enforced.max(quota)
    }

    /// Whether waiting cannot help: a refusing window could never hold this
    /// request's cost (for quota rules: every one of them has such a window).
    pub fn never_fits(&self) -> bool {
        let never = |r: &RuleOutcome| r.windows.iter().any(|w| w.never);
        let mut quotas = self.refusing().filter(|r| r.rule.quota).peekable();
        let quota_never = quotas.peek().is_some() && quotas.all(never);
        quota_never || self.refusing().filter(|r| !r.rule.quota).any(never)
    }

    /// The window with the least room left among enforcing rules (ties go to
    /// the one that frees up last), for the headers on an admitted response.
    pub fn tightest(&self) -> Option<(&RuleOutcome, &WindowOutcome)> {
        self.rules
            .iter()
            .filter(|r| !r.rule.shadow)
            .flat_map(|r| r.windows.iter().map(move |w| (r, w)))
            .min_by_key(|(_, w)| (w.remaining, std::cmp::Reverse(w.reset_ms)))
    }

    /// The status a refused caller gets: the first refusing rule's, or 503
    /// when the store failed closed.
    pub fn status(&self) -> http::StatusCode {
        match self.verdict {
            Verdict::FailedClosed => http::StatusCode::SERVICE_UNAVAILABLE,
            _ => self
                .refusing()
                .next()
                .map(|r| r.rule.status)
                .unwrap_or(http::StatusCode::OK),
        }
    }
}

