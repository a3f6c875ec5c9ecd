//! Live limits: watch the limits file and swap in every good version of it.
//!
//! The file's *directory* is watched, so in-place writes, write-then-rename
//! (vim, deploy tools) and Kubernetes ConfigMap `..data` symlink swaps are all
//! seen. Events are debounced, the content is hashed, and only a changed,
//! valid file is swapped in (atomically, with `arc-swap`): requests never wait
//! on a reload, requests in flight keep the limits they started with, and a
//! bad or half-written file changes nothing but the reported error. A slow
//! poll backs the watcher up in case an event is lost.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use notify::{RecursiveMode, Watcher};
use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use crate::config::{self, ConfigError, Limits};

/// Quiet time after the last file event before the file is read.
const DEBOUNCE: Duration = Duration::from_millis(50);
/// How often the file is checked even without events.
const POLL: Duration = Duration::from_secs(2);

/// How the limits file stands, for the admin endpoint and metrics.
#[derive(Debug, Clone, Serialize)]
pub struct ReloadStatus {
    /// The limits file.
    pub file: String,
    /// Content hash of the active limits (first 16 hex digits of SHA-256).
    pub version: String,
    /// When the active limits were loaded, RFC 3339.
    pub loaded_at: String,
    /// The last reload error, until a good file replaces it.
    pub last_error: Option<String>,
    /// False while the file is missing (the last good limits stay in force).
    pub file_present: bool,
    /// Successful reloads since start.
    pub reloads_ok: u64,
    /// Refused reloads since start.
    pub reloads_failed: u64,
}

/// Why a reload changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The file is gone; the last good limits stay.
    #[error("{0}: limits file missing; keeping the last good limits")]
    Missing(String),
    /// The file could not be read.
    #[error("{0}: cannot read: {1}")]
    Read(String, std::io::Error),
    /// The file is invalid; the last good limits stay.
    #[error("{0}; keeping the last good limits")]
    Invalid(ConfigError),
}

/// What a reload did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reloaded {
    /// New limits are active.
    Changed,
    /// The file holds what is already active.
    Unchanged,
}

/// The domain each file of a catalog holds, so that a reload is validated
/// exactly as start-up is: two files never declare one domain (they would
/// share counter keys, and one rule's expiry would wipe the other's
/// history), unless envoyproxy/ratelimit files are merged by domain.
/// A file, the domain it declares, and the limits it has in force.
type DomainOf = (PathBuf, String, Arc<ArcSwap<Limits>>);

struct Domains {
    /// Each file's path, its domain, and its active limits, in file order.
    by_file: Mutex<Vec<DomainOf>>,
    merge: bool,
    /// The limits in force per domain (files of one domain merged),
    /// rebuilt whenever a file's limits change, so a lookup is one probe.
    index: ArcSwap<HashMap<String, Arc<Limits>>>,
    /// Rebuilds one at a time, each from the latest limits.
    rebuilding: Mutex<()>,
    /// Set while a directory's files are reloaded one by one: the index is
    /// rebuilt once they all are, so two files swapping domains in one
    /// deploy never leave a domain unserved in between.
    held: std::sync::atomic::AtomicBool,
}

impl Domains {
    fn rebuild(&self) {
        if self.held.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let _one = self.rebuilding.lock().unwrap_or_else(|e| e.into_inner());
        let mut parts: Vec<(String, Vec<Arc<Limits>>)> = Vec::new();
        for (_, _, active) in self.by_file.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let limits = active.load_full();
            match parts.iter_mut().find(|(d, _)| *d == limits.domain) {
                Some((_, list)) => list.push(limits),
                None => parts.push((limits.domain.clone(), vec![limits])),
            }
        }
        let index = parts
            .into_iter()
            .filter_map(|(domain, mut list)| {
                let limits = if list.len() == 1 {
                    list.pop()?
                } else {
                    match Limits::merge(&list) {
                        Ok(merged) => Arc::new(merged),
                        // Every change is checked against this first, so it
                        // cannot happen; serve the first file rather than none.
                        Err(e) => {
                            tracing::error!(%domain, "{e}");
                            list.into_iter().next()?
                        }
                    }
                };
                Some((domain, limits))
            })
            .collect();
        self.index.store(Arc::new(index));
    }

    /// Why `limits` cannot be in force beside the other files: another file
    /// declares its domain, or merging with them fails. `replacing` is the
    /// file these limits are a new version of (on reload), if any.
    fn conflict(taken: &[DomainOf], merge: bool, replacing: Option<&Path>, limits: &Limits) -> Option<String> {
        if merge {
            let mut parts: Vec<Arc<Limits>> = Vec::new();
            let mut placed = false;
            for (p, _, active) in taken {
                if Some(p.as_path()) == replacing {
                    parts.push(Arc::new(limits.clone()));
                    placed = true;
                } else {
                    let a = active.load_full();
                    if a.domain == limits.domain {
                        parts.push(a);
                    }
                }
            }
            if !placed {
                parts.push(Arc::new(limits.clone()));
            }
            return match parts.len() > 1 {
                true => Limits::merge(&parts)
                    .err()
                    .map(|reason| format!("cannot merge with the other files of its domain: {reason}")),
                false => None,
            };
        }
        // Start-up validates the files as they are on disk; so does a
        // reload: another file counts with the domain its file now declares
        // (two files swapping domains in one deploy is fine), or its active
        // one while that file is unreadable or invalid.
        taken
            .iter()
            .filter(|(p, _, _)| Some(p.as_path()) != replacing)
            .map(|(p, _, active)| {
                let on_disk = std::fs::read_to_string(p)
                    .ok()
                    .and_then(|text| config::parse_str(&text, &p.display().to_string()).ok());
                (
                    p.clone(),
                    on_disk.map_or_else(|| active.load().domain.clone(), |l| l.domain),
                )
            })
            .find(|(_, d)| *d == limits.domain)
            .map(|(other, domain)| {
                format!(
                    "domain \"{domain}\" is already declared by {}; use one file per domain",
                    other.display()
                )
            })
    }
}

/// One limits file and the limits it currently stands for.
pub struct LiveLimits {
    path: PathBuf,
    /// Shared with the other files of the catalog, once it is assembled.
    domains: std::sync::OnceLock<Arc<Domains>>,
    active: Arc<ArcSwap<Limits>>,
    status: ArcSwap<ReloadStatus>,
    /// Hash of the last content looked at (good or bad), to skip re-parsing.
    last_seen: Mutex<Option<String>>,
    /// The file's identity, size and mtime when last read: the backstop
    /// poll reads the file only when they change, so a large file at rest
    /// costs a `stat` every poll, not a read and a hash.
    last_stat: Mutex<Option<FileStamp>>,
    on_change: Mutex<Vec<Box<dyn Fn() + Send + Sync>>>,
}

impl LiveLimits {
    /// Loads `path` for the first time; a bad file here is fatal to start-up.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = config::read_limits(path).map_err(|e| ConfigError {
            file: path.display().to_string(),
            line: None,
            reason: format!("cannot read: {e}"),
        })?;
        let limits = config::parse_str(&text, &path.display().to_string())?;
        let version = hash(&text);
        let status = ReloadStatus {
            file: path.display().to_string(),
            version: version.clone(),
            loaded_at: now_rfc3339(),
            last_error: None,
            file_present: true,
            reloads_ok: 0,
            reloads_failed: 0,
        };
        crate::metrics::get().config_version(&path.display().to_string(), &version);
        Ok(LiveLimits {
            path: path.to_path_buf(),
            domains: std::sync::OnceLock::new(),
            active: Arc::new(ArcSwap::from_pointee(limits)),
            status: ArcSwap::from_pointee(status),
            last_seen: Mutex::new(Some(version)),
            last_stat: Mutex::new(FileStamp::of(path)),
            on_change: Mutex::new(Vec::new()),
        })
    }

    /// The handle surfaces read the active limits from.
    pub fn active(&self) -> Arc<ArcSwap<Limits>> {
        self.active.clone()
    }

    /// The file's current standing.
    pub fn status(&self) -> Arc<ReloadStatus> {
        self.status.load_full()
    }

    /// Runs `f` after every change of the active limits (e.g. to drop caches).
    pub fn on_change(&self, f: impl Fn() + Send + Sync + 'static) {
        self.on_change
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Box::new(f));
    }

    /// Reads the file and swaps its limits in if it changed and is valid.
    pub fn reload(&self) -> Result<Reloaded, ReloadError> {
        self.reload_inner(true)
    }

    /// As [`LiveLimits::reload`]; unless `force`d, a file whose identity,
    /// size and mtime are those last read is taken as unchanged unread.
    fn reload_inner(&self, force: bool) -> Result<Reloaded, ReloadError> {
        let stamp = FileStamp::of(&self.path);
        {
            let mut last = self.last_stat.lock().unwrap_or_else(|e| e.into_inner());
            if !force && stamp.is_some() && *last == stamp && self.status().last_error.is_none() {
                return Ok(Reloaded::Unchanged);
            }
            *last = stamp;
        }
        let name = self.path.display().to_string();
        let text = match config::read_limits(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let was_present = self.status().file_present;
                self.update_status(|s| s.file_present = false);
                *self.last_seen.lock().unwrap_or_else(|e| e.into_inner()) = None;
                return if was_present {
                    Err(ReloadError::Missing(name))
                } else {
                    Ok(Reloaded::Unchanged)
                };
            }
            Err(e) => {
                // A directory in its place, no permission, a link loop, too
                // large: shown on /config and in the metrics like a bad file.
                let message = format!("{name}: cannot read: {e}");
                crate::metrics::get().reload(&name, false);
                *self.last_seen.lock().unwrap_or_else(|e| e.into_inner()) = None;
                self.update_status(|s| {
                    s.last_error = Some(message);
                    s.file_present = true;
                    s.reloads_failed = s.reloads_failed.saturating_add(1);
                });
                return Err(ReloadError::Read(name, e));
            }
        };
        let version = hash(&text);
        {
            let mut last = self.last_seen.lock().unwrap_or_else(|e| e.into_inner());
            if last.as_deref() == Some(version.as_str()) {
                self.update_status(|s| s.file_present = true);
                return Ok(Reloaded::Unchanged);
            }
            *last = Some(version.clone());
        }
        // The domain check and the swap happen under one lock, so two files
        // reloaded at once cannot both take the same domain.
        let domains = self.domains.get();
        let merge = domains.is_some_and(|d| d.merge);
        let mut taken = domains.map(|d| d.by_file.lock().unwrap_or_else(|e| e.into_inner()));
        let mut clashed = false;
        let parsed = config::parse_str(&text, &name).and_then(|limits| {
            match taken
                .as_ref()
                .and_then(|t| Domains::conflict(t, merge, Some(&self.path), &limits))
            {
                Some(reason) => {
                    clashed = true;
                    Err(ConfigError {
                        file: name.clone(),
                        line: None,
                        reason,
                    })
                }
                None => Ok(limits),
            }
        });
        if clashed {
            // Valid on its own: try it again once the other file moves away.
            *self.last_seen.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
        match parsed {
            Ok(limits) => {
                if let Some(taken) = taken.as_mut()
                    && let Some(entry) = taken.iter_mut().find(|(p, _, _)| *p == self.path)
                {
                    entry.1 = limits.domain.clone();
                }
                self.active.store(Arc::new(limits));
                drop(taken);
                crate::metrics::get().reload(&name, true);
                crate::metrics::get().config_version(&name, &version);
                self.update_status(|s| {
                    s.version = version.clone();
                    s.loaded_at = now_rfc3339();
                    s.last_error = None;
                    s.file_present = true;
                    s.reloads_ok += 1;
                });
                for f in self.on_change.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                    f();
                }
                Ok(Reloaded::Changed)
            }
            Err(e) => {
                crate::metrics::get().reload(&name, false);
                self.update_status(|s| {
                    s.last_error = Some(e.to_string());
                    s.file_present = true;
                    s.reloads_failed += 1;
                });
                Err(ReloadError::Invalid(e))
            }
        }
    }

    /// Reloads and logs the outcome in one line.
    pub fn reload_and_log(&self, cause: &str) {
        let error_before = self.status().last_error.clone();
        // The poll is a backstop for lost events: it looks at the file's
        // stamp first. An event or an operator's SIGHUP always reads.
        match self.reload_inner(cause != "poll") {
            Ok(Reloaded::Changed) => {
                let status = self.status();
                let limits = self.active.load();
                tracing::info!(cause, file = %status.file, version = %status.version, rules = limits.rules.len(), "limits reloaded");
            }
            // Only an operator's SIGHUP expects an answer when nothing changed.
            Ok(Reloaded::Unchanged) if cause == "SIGHUP" => {
                tracing::info!(cause, file = %self.path.display(), "limits unchanged")
            }
            Ok(Reloaded::Unchanged) => tracing::debug!(cause, file = %self.path.display(), "limits unchanged"),
            // The same refusal again (a file waiting for another to give
            // up its domain is re-read on every poll): said once.
            Err(e) if cause != "SIGHUP" && error_before.is_some() && self.status().last_error == error_before => {
                tracing::debug!(cause, "{e}")
            }
            Err(e) => tracing::error!(cause, "{e}"),
        }
    }

    fn update_status(&self, f: impl FnOnce(&mut ReloadStatus)) {
        let mut next = (*self.status.load_full()).clone();
        f(&mut next);
        self.status.store(Arc::new(next));
    }

    /// Watches the file's directory (and polls as a backstop) until the
    /// returned guard is dropped. Must be called inside a tokio runtime.
    pub fn watch(self: &Arc<Self>) -> notify::Result<WatchGuard> {
        let dir = match self.path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let (tx, mut rx) = mpsc::unbounded_channel();
        let file_name = self.path.file_name().map(|n| n.to_os_string());
        // Set when the watched directory itself goes (its inode may be
        // reused by the one made next, so identity alone cannot tell).
        let dir_gone = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let gone = dir_gone.clone();
        let watched_dir = dir.clone();
        let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            if let Ok(event) = &event
                && event.kind.is_remove()
                && event.paths.contains(&watched_dir)
            {
                gone.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            if let Ok(event) = event
                && changes_content(&event)
                && concerns(&event, file_name.as_deref())
            {
                let _ = tx.send(());
            }
        })?;
        watcher.watch(&dir, RecursiveMode::NonRecursive)?;
        let mut watched = dir_identity(&dir);
        let live = self.clone();
        let task = tokio::spawn(async move {
            let mut poll = tokio::time::interval(POLL);
            poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    event = rx.recv() => {
                        if event.is_none() {
                            return;
                        }
                        if !settled(&mut rx).await {
                            return;
                        }
                        let live = live.clone();
                        let _ = tokio::task::spawn_blocking(move || live.reload_and_log("file changed")).await;
                    }
                    _ = poll.tick() => {
                        // A directory deleted and made again is a new one:
                        // the old watch died with it, so watch the new one.
                        let now = dir_identity(&dir);
                        if now != watched || (now.is_some() && dir_gone.swap(false, std::sync::atomic::Ordering::SeqCst)) {
                            let _ = watcher.unwatch(&dir);
                            watched = match now {
                                Some(_) => match watcher.watch(&dir, RecursiveMode::NonRecursive) {
                                    Ok(()) => {
                                        tracing::info!(dir = %dir.display(), "watching the limits file's directory again");
                                        now
                                    }
                                    Err(e) => {
                                        tracing::warn!(dir = %dir.display(), error = %e, "cannot watch the limits file's directory; polling");
                                        None
                                    }
                                },
                                None => None,
                            };
                        }
                        let live = live.clone();
                        let _ = tokio::task::spawn_blocking(move || live.reload_and_log("poll")).await;
                    }
                }
            }
        });
        Ok(WatchGuard { task })
    }
}

/// Lets a burst of events (an editor's save) settle: waits until none has
/// come for [`DEBOUNCE`]. False when the watcher is gone.
async fn settled(rx: &mut mpsc::UnboundedReceiver<()>) -> bool {
    loop {
        match tokio::time::timeout(DEBOUNCE, rx.recv()).await {
            Ok(Some(())) => continue,
            Ok(None) => return false,
            Err(_) => return true,
        }
    }
}

/// Keeps a file watch alive; dropping it stops watching.
pub struct WatchGuard {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A directory's device and inode: a directory made again has new ones.
fn dir_identity(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(dir).ok().map(|m| (m.dev(), m.ino()))
}

/// What identifies one version of a file without reading it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileStamp {
    device: u64,
    inode: u64,
    len: u64,
    modified: Option<SystemTime>,
}

impl FileStamp {
    fn of(path: &Path) -> Option<FileStamp> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).ok()?;
        Some(FileStamp {
            device: m.dev(),
            inode: m.ino(),
            len: m.len(),
            modified: m.modified().ok(),
        })
    }
}

/// Whether an event can change what the file holds: writes, creates,
/// removes and renames, not opens, reads or access times (tollgate's own
/// read of the file would otherwise set off the next reload, forever).
fn changes_content(event: &notify::Event) -> bool {
    use notify::EventKind;
    use notify::event::{AccessKind, AccessMode, MetadataKind, ModifyKind};
    match event.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) => false,
        EventKind::Modify(ModifyKind::Metadata(MetadataKind::AccessTime)) => false,
        _ => true,
    }
}

/// Whether an event names the limits file, a Kubernetes ConfigMap's
/// `..data` swap, or no file at all (a rescan): not a neighbour's log.
fn concerns(event: &notify::Event, file_name: Option<&std::ffi::OsStr>) -> bool {
    event.paths.is_empty()
        || event.paths.iter().any(|p| match p.file_name() {
            Some(n) => Some(n) == file_name || n.to_string_lossy().starts_with(".."),
            None => true,
        })
}

fn hash(text: &str) -> String {
    let digest = Sha256::digest(text.as_bytes());
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(SystemTime::now()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "domain: d\nrules:\n  - name: r\n    limits: [{requests: 1, per: 1s}]\n";
    const B: &str = "domain: d\nrules:\n  - name: r\n    limits: [{requests: 2, per: 1s}]\n";

    fn limit(live: &LiveLimits) -> u64 {
        live.active().load().rules[0].windows[0].requests
    }

    #[test]
    fn only_good_changed_files_are_swapped_in() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.yaml");
        std::fs::write(&path, A).unwrap();
        let live = LiveLimits::load(&path).unwrap();
        let changes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = changes.clone();
        live.on_change(move || {
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        });
        assert_eq!(live.reload().unwrap(), Reloaded::Unchanged);

        std::fs::write(
            &path,
            "domain: d\nrules:\n  - name: r\n    limits: [{requests: 0, per: 1s}]\n",
        )
        .unwrap();
        let err = live.reload().unwrap_err();
        assert!(err.to_string().contains("l.yaml:4: "), "{err}");
        assert_eq!(limit(&live), 1);
        assert!(
            live.status()
                .last_error
                .as_deref()
                .unwrap()
                .contains("requests must be at least 1")
        );

        std::fs::write(&path, B).unwrap();
        assert_eq!(live.reload().unwrap(), Reloaded::Changed);
        assert_eq!(limit(&live), 2);
        assert_eq!(live.status().last_error, None);
        assert_eq!(live.status().reloads_ok, 1);
        assert_eq!(live.status().reloads_failed, 1);
        assert_eq!(changes.load(std::sync::atomic::Ordering::SeqCst), 1);

        std::fs::remove_file(&path).unwrap();
        assert!(matches!(live.reload(), Err(ReloadError::Missing(_))));
        assert!(!live.status().file_present);
        assert_eq!(limit(&live), 2, "a deleted file keeps the last good limits");
        assert_eq!(live.reload().unwrap(), Reloaded::Unchanged, "said once");
        std::fs::write(&path, A).unwrap();
        assert_eq!(live.reload().unwrap(), Reloaded::Changed);
        assert!(live.status().file_present);
        assert_eq!(limit(&live), 1);
    }

    #[test]
    fn only_events_that_can_change_the_file_reload_it() {
        use notify::EventKind;
        use notify::event::{AccessKind, AccessMode, CreateKind, ModifyKind, RenameMode};
        let event = |kind, path: &str| notify::Event::new(kind).add_path(PathBuf::from(path));
        let name = Some(std::ffi::OsStr::new("limits.yaml"));
        // tollgate's own read (and anyone's cat) opens and closes the file.
        for kind in [
            EventKind::Access(AccessKind::Open(AccessMode::Read)),
            EventKind::Access(AccessKind::Close(AccessMode::Read)),
            EventKind::Access(AccessKind::Read),
        ] {
            assert!(!changes_content(&event(kind, "/d/limits.yaml")), "{kind:?}");
        }
        for kind in [
            EventKind::Access(AccessKind::Close(AccessMode::Write)),
            EventKind::Modify(ModifyKind::Any),
            EventKind::Modify(ModifyKind::Name(RenameMode::To)),
            EventKind::Create(CreateKind::File),
        ] {
            assert!(changes_content(&event(kind, "/d/limits.yaml")), "{kind:?}");
        }
        assert!(concerns(&event(EventKind::Any, "/d/limits.yaml"), name));
        assert!(concerns(&event(EventKind::Any, "/d/..data"), name), "ConfigMap swap");
        assert!(
            !concerns(&event(EventKind::Any, "/d/app.log"), name),
            "a neighbour's log"
        );
    }

    #[test]
    fn huge_files_and_endless_ones_are_not_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big.yaml");
        std::fs::write(&big, vec![b'#'; crate::config::MAX_FILE_BYTES + 1]).unwrap();
        assert!(
            config::read_limits(&big)
                .unwrap_err()
                .to_string()
                .contains("larger than 8 MiB")
        );
        let zero = dir.path().join("zero.yaml");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        assert!(config::read_limits(&zero).is_err());
        // A directory in the file's place is an error on /config, not silence.
        let path = dir.path().join("l.yaml");
        std::fs::write(&path, A).unwrap();
        let live = LiveLimits::load(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        assert!(matches!(live.reload(), Err(ReloadError::Read(..))));
        let status = live.status();
        assert!(
            status.last_error.as_deref().unwrap_or("").contains("cannot read"),
            "{status:?}"
        );
        assert_eq!(limit(&live), 1, "the last good limits stay");
    }

    #[test]
    fn a_reload_cannot_take_another_files_domain() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.yaml");
        let b = dir.path().join("b.yaml");
        std::fs::write(&a, A).unwrap();
        std::fs::write(&b, A.replace("domain: d", "domain: e")).unwrap();
        let catalog = Catalog::load(&[a.clone(), b.clone()], false).unwrap();
        std::fs::write(&b, B).unwrap();
        let err = catalog.files()[1].reload().unwrap_err();
        assert!(err.to_string().contains("already declared by"), "{err}");
        assert_eq!(
            catalog.domain("e").unwrap().rules[0].windows[0].requests,
            1,
            "nothing changed"
        );
        assert_eq!(catalog.domain("d").unwrap().rules[0].windows[0].requests, 1);
        // Renaming a's domain frees "d" for b.
        std::fs::write(&a, A.replace("domain: d", "domain: f")).unwrap();
        catalog.files()[0].reload().unwrap();
        assert_eq!(catalog.files()[1].reload().unwrap(), Reloaded::Changed);
        assert_eq!(catalog.domain("d").unwrap().rules[0].windows[0].requests, 2);
        // Two files swapping domains in one deploy: valid on disk, so both load.
        std::fs::write(&a, B).unwrap();
        std::fs::write(&b, A.replace("domain: d", "domain: f")).unwrap();
        catalog.reload_all("test");
        assert_eq!(catalog.domain("d").unwrap().rules[0].windows[0].requests, 2);
        assert_eq!(catalog.domain("f").unwrap().rules[0].windows[0].requests, 1);
        assert!(catalog.files().iter().all(|f| f.status().last_error.is_none()));
    }
}

/// Every limits file tollgate serves, each live, and the limits in force
/// for each domain. A `--config` path may be a directory: every `.yaml`,
/// `.yml` and `.json` file in it is served, and files added to or removed
/// from it while running add or drop their domains (envoyproxy/ratelimit's
/// runtime directory).
pub struct Catalog {
    /// What `--config` named, files and directories.
    sources: Vec<PathBuf>,
    files: ArcSwap<Vec<Arc<LiveLimits>>>,
    domains: Arc<Domains>,
    callbacks: Mutex<Vec<Callback>>,
    /// Why each file of a directory is kept out, so it is said once.
    refused: Mutex<HashMap<PathBuf, String>>,
}

type Callback = Arc<dyn Fn() + Send + Sync>;

/// Why a set of limits files cannot be served together.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    /// One of the files is invalid.
    #[error("{0}")]
    Config(#[from] ConfigError),
    /// Two files declare the same domain.
    #[error("{0} and {1} both declare domain \"{2}\"; use one file per domain")]
    DuplicateDomain(String, String, String),
    /// Files of one domain cannot be merged.
    #[error("{0}: {1}")]
    Merge(String, String),
    /// A directory named by `--config` cannot be listed.
    #[error("{0}: cannot list: {1}")]
    Dir(String, std::io::Error),
}

/// The limits files of a directory and its sub-directories, in path order:
/// every file, as envoyproxy/ratelimit reads them (`.json` ones as JSON, the
/// rest as YAML), but no hidden ones (a Kubernetes volume's `..data`).
fn files_in(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    collect_files(dir, 0, &mut files)?;
    files.sort();
    Ok(files)
}

/// Deepest sub-directory read (a link loop must not recurse forever).
const MAX_DEPTH: usize = 8;

fn collect_files(dir: &Path, depth: usize, files: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)?.filter_map(Result::ok) {
        let path = entry.path();
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        // A linked directory is not entered (as envoyproxy/ratelimit's walk
        // does not): a link back up the tree would read files twice. Linked
        // files are followed; a dangling link is kept, so it is reported.
        let linked = entry.file_type().is_ok_and(|t| t.is_symlink());
        if path.is_dir() {
            if !linked && depth < MAX_DEPTH {
                let _ = collect_files(&path, depth.saturating_add(1), files);
            }
        } else {
            files.push(path);
        }
    }
    Ok(())
}

impl Catalog {
    /// Loads every file (and every file of every directory); any invalid
    /// file or a repeated domain is fatal here. With `merge`,
    /// envoyproxy/ratelimit files may share a domain and are merged (their
    /// `MERGE_DOMAIN_CONFIG`).
    pub fn load(sources: &[PathBuf], merge: bool) -> Result<Self, CatalogError> {
        let mut paths = Vec::new();
        for source in sources {
            if source.is_dir() {
                paths.extend(files_in(source).map_err(|e| CatalogError::Dir(source.display().to_string(), e))?);
            } else {
                paths.push(source.clone());
            }
        }
        let mut files: Vec<Arc<LiveLimits>> = Vec::with_capacity(paths.len());
        let mut taken: Vec<DomainOf> = Vec::with_capacity(paths.len());
        for path in &paths {
            let live = Arc::new(LiveLimits::load(path)?);
            let limits = live.active().load_full();
            if let Some(reason) = Domains::conflict(&taken, merge, None, &limits) {
                return Err(match files.iter().find(|f| f.active().load().domain == limits.domain) {
                    Some(other) if !merge => CatalogError::DuplicateDomain(
                        other.status().file.clone(),
                        live.status().file.clone(),
                        limits.domain.clone(),
                    ),
                    _ => CatalogError::Merge(live.status().file.clone(), reason),
                });
            }
            taken.push((path.clone(), limits.domain.clone(), live.active()));
            files.push(live);
        }
        let domains = Arc::new(Domains {
            by_file: Mutex::new(taken),
            merge,
            index: ArcSwap::from_pointee(HashMap::new()),
            rebuilding: Mutex::new(()),
            held: std::sync::atomic::AtomicBool::new(false),
        });
        domains.rebuild();
        for f in &files {
            Self::attach(f, &domains);
        }
        Ok(Catalog {
            sources: sources.to_vec(),
            files: ArcSwap::from_pointee(files),
            domains,
            callbacks: Mutex::new(Vec::new()),
            refused: Mutex::new(HashMap::new()),
        })
    }

    /// Ties a file to the catalog's domain checks and index.
    fn attach(file: &Arc<LiveLimits>, domains: &Arc<Domains>) {
        let _ = file.domains.set(domains.clone());
        let index = domains.clone();
        file.on_change(move || index.rebuild());
    }

    /// The files served now, in `--config` order (a directory's by name).
    pub fn files(&self) -> Arc<Vec<Arc<LiveLimits>>> {
        self.files.load_full()
    }

    /// Files of a watched directory kept out (invalid, unreadable, or
    /// declaring a domain another file holds), with why.
    pub fn refused(&self) -> Vec<(PathBuf, String)> {
        let refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        let mut list: Vec<(PathBuf, String)> = refused.iter().map(|(p, r)| (p.clone(), r.clone())).collect();
        list.sort();
        list
    }

    /// The limits in force for `domain`, for the Envoy RLS surface.
    pub fn domain(&self, domain: &str) -> Option<Arc<Limits>> {
        self.domains.index.load().get(domain).cloned()
    }

    /// Brings a directory's files in line with what it holds now: new ones
    /// are loaded (a bad one is kept out, with its error said once), gone
    /// ones dropped with their domain, the others reloaded.
    fn rescan(&self, dir: &Path, cause: &str) {
        let on_disk = match files_in(dir) {
            Ok(list) => list,
            // The directory is gone or unreadable for now: keep serving what
            // it held (the file watcher's rule: a missing file changes nothing).
            Err(e) => {
                tracing::debug!(dir = %dir.display(), error = %e, "cannot list the limits directory");
                return;
            }
        };
        let current = self.files();
        let mut changed = false;
        let mut next: Vec<Arc<LiveLimits>> = Vec::with_capacity(on_disk.len());
        for f in current.iter() {
            let from_dir = f.path.starts_with(dir) && !self.sources.contains(&f.path);
            if from_dir && !on_disk.contains(&f.path) {
                let domain = f.active().load().domain.clone();
                self.domains
                    .by_file
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .retain(|(p, _, _)| *p != f.path);
                tracing::info!(cause, file = %f.path.display(), %domain, "limits file removed; its limits no longer apply");
                changed = true;
            } else {
                next.push(f.clone());
            }
        }
        for path in &on_disk {
            if next.iter().any(|f| f.path == *path) {
                continue;
            }
            match self.admit(path) {
                Ok(live) => {
                    self.refused.lock().unwrap_or_else(|e| e.into_inner()).remove(path);
                    let limits = live.active().load_full();
                    tracing::info!(cause, file = %path.display(), domain = %limits.domain, rules = limits.rules.len(), "limits file added");
                    next.push(live);
                    changed = true;
                }
                Err(reason) => {
                    let mut refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
                    if refused.get(path) != Some(&reason) {
                        tracing::error!(cause, "{reason}; not served until fixed");
                        crate::metrics::get().reload(&path.display().to_string(), false);
                        refused.insert(path.clone(), reason);
                    }
                }
            }
        }
        self.refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|p, _| on_disk.contains(p));
        if changed {
            // Keep `--config` order: sources first, a directory's files by name.
            let order = |f: &Arc<LiveLimits>| {
                let i = self
                    .sources
                    .iter()
                    .position(|s| f.path.starts_with(s))
                    .unwrap_or(usize::MAX);
                (i, f.path.clone())
            };
            next.sort_by_key(order);
            self.files.store(Arc::new(next.clone()));
            self.domains.rebuild();
            for f in self.callbacks.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                f();
            }
        }
        self.domains.held.store(true, std::sync::atomic::Ordering::SeqCst);
        for f in next.iter().filter(|f| on_disk.contains(&f.path)) {
            f.reload_and_log(cause);
        }
        self.domains.held.store(false, std::sync::atomic::Ordering::SeqCst);
        self.domains.rebuild();
    }

    /// Loads a file that appeared in a directory and puts it in force,
    /// unless it is invalid or its domain clashes.
    fn admit(&self, path: &Path) -> Result<Arc<LiveLimits>, String> {
        let live = Arc::new(LiveLimits::load(path).map_err(|e| e.to_string())?);
        let limits = live.active().load_full();
        let mut taken = self.domains.by_file.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(reason) = Domains::conflict(&taken, self.domains.merge, None, &limits) {
            return Err(format!("{}: {reason}", path.display()));
        }
        taken.push((path.to_path_buf(), limits.domain.clone(), live.active()));
        drop(taken);
        Self::attach(&live, &self.domains);
        for f in self.callbacks.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let f = f.clone();
            live.on_change(move || f());
        }
        Ok(live)
    }

    /// The counters an HTTP request touches, across every file.
    pub fn http_hits(
        &self,
        req: &crate::limits::RequestInfo<'_>,
    ) -> Result<Vec<crate::limiter::Hit>, crate::limits::RequestError> {
        let mut hits = Vec::new();
        for file in self.files.load().iter() {
            hits.extend(crate::limits::hits(&file.active.load(), req)?);
        }
        Ok(hits)
    }

    /// Runs `f` after any file's limits change, and when files come or go.
    pub fn on_change(&self, f: impl Fn() + Send + Sync + 'static) {
        let f: Callback = Arc::new(f);
        for file in self.files.load().iter() {
            let f = f.clone();
            file.on_change(move || f());
        }
        self.callbacks.lock().unwrap_or_else(|e| e.into_inner()).push(f);
    }

    /// Reloads every file and rescans every directory (SIGHUP).
    pub fn reload_all(&self, cause: &str) {
        for source in &self.sources {
            if source.is_dir() {
                self.rescan(source, cause);
            } else if let Some(f) = self.files.load().iter().find(|f| f.path == *source) {
                f.reload_and_log(cause);
            }
        }
    }

    /// Watches every file (see [`LiveLimits::watch`]) and every directory
    /// (rescanned on any change in it, and polled as a backstop).
    pub fn watch(self: &Arc<Self>) -> notify::Result<Vec<WatchGuard>> {
        let mut guards = Vec::new();
        for source in &self.sources {
            if source.is_dir() {
                guards.push(self.watch_dir(source.clone())?);
            } else if let Some(f) = self.files.load().iter().find(|f| f.path == *source) {
                guards.push(f.watch()?);
            }
        }
        Ok(guards)
    }

    fn watch_dir(self: &Arc<Self>, dir: PathBuf) -> notify::Result<WatchGuard> {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            if let Ok(event) = event
                && changes_content(&event)
            {
                let _ = tx.send(());
            }
        })?;
        watcher.watch(&dir, RecursiveMode::Recursive)?;
        let mut watched = dir_identity(&dir);
        let catalog = self.clone();
        let task = tokio::spawn(async move {
            // Owned by the task: dropping the guard stops both.
            let mut watcher = watcher;
            let mut poll = tokio::time::interval(POLL);
            poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let cause = tokio::select! {
                    event = rx.recv() => {
                        if event.is_none() {
                            return;
                        }
                        if !settled(&mut rx).await {
                            return;
                        }
                        "file changed"
                    }
                    _ = poll.tick() => {
                        // A directory deleted and made again is a new one:
                        // the old watch died with it.
                        let now = dir_identity(&dir);
                        if now != watched {
                            let _ = watcher.unwatch(&dir);
                            watched = now.filter(|_| watcher.watch(&dir, RecursiveMode::Recursive).is_ok());
                            if watched.is_some() {
                                tracing::info!(dir = %dir.display(), "watching the limits directory again");
                            }
                        }
                        "poll"
                    }
                };
                let (catalog, dir) = (catalog.clone(), dir.clone());
                let _ = tokio::task::spawn_blocking(move || catalog.rescan(&dir, cause)).await;
            }
        });
        Ok(WatchGuard { task })
    }
}
