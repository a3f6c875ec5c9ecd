//! One live limits file: on every reload (a watch event, the poll, SIGHUP),
//! read it and swap in its limits only if it changed and is valid.
//!
//! The content is hashed and a file whose stamp (identity, size, mtime) is
//! unchanged is not read on a poll. A swap is atomic (`arc-swap`): requests
//! never wait on a reload, requests in flight keep the limits they started
//! with, and a bad or half-written file changes nothing but the reported
//! error. When (the watch) is in [`super::watch`].

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use arc_swap::ArcSwap;
use serde::Serialize;
use sha2::{Digest, Sha256};

use super::InForce;
use crate::config::{self, ConfigError, Limits};

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
    /// Valid, but it declares a domain another file holds; not yet
    /// recorded as a failure (a directory rescan decides once it has read a
    /// steady version of every file).
    #[error("{0}; keeping the last good limits")]
    Clash(ConfigError),
}

/// What a reload did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reloaded {
    /// New limits are active.
    Changed,
    /// The file holds what is already active.
    Unchanged,
}

/// One limits file and the limits it currently stands for.
pub struct LiveFile {
    pub(super) path: PathBuf,
    /// Shared with the other files of the catalog, once it is assembled.
    pub(super) in_force: std::sync::OnceLock<Arc<InForce>>,
    active: Arc<ArcSwap<Limits>>,
    status: ArcSwap<ReloadStatus>,
    /// Hash of the last content looked at (good or bad), to skip re-parsing.
    last_seen: Mutex<Option<String>>,
    /// The file's identity, size and mtime when last read: the backstop
    /// poll reads the file only when they change, so a large file at rest
    /// costs a `stat` every poll, not a read and a hash.
    last_stat: Mutex<Option<FileStamp>>,
    /// The file at `last_stat` could not be read (too large, a directory,
    /// no permission): the poll waits for its stamp to change instead of
    /// reading, and counting a failed reload, every 2 s.
    unreadable: std::sync::atomic::AtomicBool,
    /// A file refused for a domain another file holds is read again every
    /// poll: the same version's refusal is counted and logged once. The
    /// version whose refusal was counted, the one refused last (to be
    /// counted by [`LiveFile::refuse`]), and whether that was a repeat.
    clash_counted: Mutex<Option<String>>,
    clash_last: Mutex<Option<String>>,
    repeat: std::sync::atomic::AtomicBool,
    on_change: Mutex<Vec<Box<dyn Fn() + Send + Sync>>>,
}

impl LiveFile {
    /// Loads `path` for the first time; a bad file here is fatal to start-up.
    /// Its version is published once it is served (a directory's file may
    /// yet be refused for its domain).
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
        Ok(LiveFile {
            path: path.to_path_buf(),
            in_force: std::sync::OnceLock::new(),
            active: Arc::new(ArcSwap::from_pointee(limits)),
            status: ArcSwap::from_pointee(status),
            last_seen: Mutex::new(Some(version)),
            last_stat: Mutex::new(FileStamp::of(path)),
            unreadable: std::sync::atomic::AtomicBool::new(false),
            clash_counted: Mutex::new(None),
            clash_last: Mutex::new(None),
            repeat: std::sync::atomic::AtomicBool::new(false),
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
        self.reload_inner(true, false)
    }

    /// As [`LiveFile::reload`], but a domain clash is answered as
    /// [`ReloadError::Clash`] and recorded only by [`LiveFile::refuse`]: in a
    /// directory changing under a rescan it may be a moment's mix of two
    /// versions, gone in the next pass.
    pub(super) fn reload_deferring_clash(&self, cause: &str) -> Result<Reloaded, ReloadError> {
        self.reload_inner(cause != "poll", true)
    }

    /// Records a refusal [`LiveFile::reload_deferring_clash`] left unrecorded.
    pub(super) fn refuse(&self, error: &ReloadError) {
        if self.repeated() {
            return;
        }
        let last = self.clash_last.lock().unwrap_or_else(|e| e.into_inner()).take();
        *self.clash_counted.lock().unwrap_or_else(|e| e.into_inner()) = last;
        crate::metrics::get().reload(&self.path.display().to_string(), false);
        let message = error.to_string();
        self.update_status(|s| {
            s.last_error = Some(message);
            s.file_present = true;
            s.reloads_failed = s.reloads_failed.saturating_add(1);
        });
    }

    /// As [`LiveFile::reload`]; unless `force`d, a file whose stamp is the
    /// one last read is taken as unchanged unread. A refused file is read
    /// again all the same (a file waiting for another to give up its
    /// domain has not changed), unless it could not be read at all.
    fn reload_inner(&self, force: bool, defer_clash: bool) -> Result<Reloaded, ReloadError> {
        use std::sync::atomic::Ordering;
        let stamp = FileStamp::of(&self.path);
        {
            let mut last = self.last_stat.lock().unwrap_or_else(|e| e.into_inner());
            if !force
                && stamp.is_some()
                && *last == stamp
                && (self.status().last_error.is_none() || self.unreadable.load(Ordering::Relaxed))
            {
                return Ok(Reloaded::Unchanged);
            }
            *last = stamp.clone();
        }
        self.unreadable.store(false, Ordering::Relaxed);
        self.repeat.store(false, Ordering::Relaxed);
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
                self.unreadable.store(true, Ordering::Relaxed);
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
        // Written while it was read (an editor or `cp` writing in place): the
        // text may be torn between two versions. Not used; the writer's next
        // event, or the poll, reads it again once it holds still.
        if FileStamp::of(&self.path) != stamp {
            *self.last_stat.lock().unwrap_or_else(|e| e.into_inner()) = None;
            tracing::debug!(file = %name, "the file changed while it was read; reading it again when it settles");
            return Ok(Reloaded::Unchanged);
        }
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
        let in_force = self.in_force.get();
        let merge = in_force.is_some_and(|d| d.merge);
        let mut taken = in_force.map(|d| d.by_file.lock().unwrap_or_else(|e| e.into_inner()));
        let mut clashed = false;
        let parsed = config::parse_str(&text, &name).and_then(|limits| {
            match taken
                .as_ref()
                .and_then(|t| InForce::conflict(t, merge, Some(&self.path), &limits))
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
        {
            let mut counted = self.clash_counted.lock().unwrap_or_else(|e| e.into_inner());
            let repeat = clashed && counted.as_deref() == Some(version.as_str());
            if !clashed {
                *counted = None;
            }
            *self.clash_last.lock().unwrap_or_else(|e| e.into_inner()) = clashed.then(|| version.clone());
            self.repeat.store(repeat, Ordering::Relaxed);
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
            Err(e) if clashed && defer_clash => Err(ReloadError::Clash(e)),
            Err(e) => {
                let error = ReloadError::Invalid(e);
                self.refuse(&error);
                Err(error)
            }
        }
    }

    /// Whether the last refusal was the same version's domain clash again:
    /// neither counted nor logged again.
    pub(super) fn repeated(&self) -> bool {
        self.repeat.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Reloads and logs the outcome in one line.
    pub fn reload_and_log(&self, cause: &str) {
        // The poll is a backstop for lost events: it looks at the file's
        // stamp first. An event or an operator's SIGHUP always reads.
        let started = std::time::Instant::now();
        let outcome = self.reload_inner(cause != "poll", false);
        self.log(cause, started, outcome);
    }

    /// Logs what a reload begun at `started` came to, in one line; a
    /// refusal already said (a domain clash read again) is not said again.
    pub(super) fn log(&self, cause: &str, started: std::time::Instant, outcome: Result<Reloaded, ReloadError>) {
        match outcome {
            Ok(Reloaded::Changed) => {
                let status = self.status();
                let limits = self.active.load();
                tracing::info!(
                    cause,
                    file = %status.file,
                    version = %status.version,
                    rules = limits.rules.len(),
                    took_ms = %super::millis(started.elapsed()),
                    index_ms = %super::millis(limits.index.built_in()),
                    "limits reloaded"
                );
            }
            // Only an operator's SIGHUP expects an answer when nothing changed.
            Ok(Reloaded::Unchanged) if cause == "SIGHUP" => {
                tracing::info!(cause, file = %self.path.display(), "limits unchanged")
            }
            Ok(Reloaded::Unchanged) => tracing::debug!(cause, file = %self.path.display(), "limits unchanged"),
            // The same refusal again (a file waiting for another to give
            // up its domain is re-read on every poll): said once. Any
            // other refusal follows a change, and is said.
            Err(e) if self.repeated() => match cause {
                // An operator's SIGHUP is answered, but the refusal was
                // counted and logged as an error when it was first met.
                "SIGHUP" => tracing::info!(cause, "still refused, unchanged since: {e}"),
                _ => tracing::debug!(cause, "{e}"),
            },
            Err(e) => tracing::error!(cause, "{e}"),
        }
    }

    fn update_status(&self, f: impl FnOnce(&mut ReloadStatus)) {
        let mut next = (*self.status.load_full()).clone();
        f(&mut next);
        self.status.store(Arc::new(next));
    }
}

/// What identifies one version of a file without reading it. The inode's
/// change time moves with a `chmod` or `chown` too: a file made readable
/// again is read at the next poll.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct FileStamp {
    device: u64,
    inode: u64,
    len: u64,
    modified: Option<SystemTime>,
    changed: (i64, i64),
}

impl FileStamp {
    pub(super) fn of(path: &Path) -> Option<FileStamp> {
        use std::os::unix::fs::MetadataExt;
        // A link that leads nowhere (a loop, a missing target) is stamped
        // as the link: it cannot be read until the link changes or its
        // target appears (which the link's target's stamp then shows).
        let m = std::fs::metadata(path)
            .or_else(|_| std::fs::symlink_metadata(path))
            .ok()?;
        Some(FileStamp {
            device: m.dev(),
            inode: m.ino(),
            len: m.len(),
            modified: m.modified().ok(),
            changed: (m.ctime(), m.ctime_nsec()),
        })
    }
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

    fn limit(live: &LiveFile) -> u64 {
        live.active().load().rules[0].windows[0].requests
    }

    #[test]
    fn only_good_changed_files_are_swapped_in() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.yaml");
        std::fs::write(&path, A).unwrap();
        let live = LiveFile::load(&path).unwrap();
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
        let live = LiveFile::load(&path).unwrap();
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

    /// A file that cannot be read is one failed reload, not one every poll
    /// (an alert on failed reloads would never clear); once it changes, the
    /// poll reads it again.
    #[test]
    fn a_file_that_cannot_be_read_is_one_failure_until_it_changes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.yaml");
        std::fs::write(&path, A).unwrap();
        let live = LiveFile::load(&path).unwrap();
        let poll = || live.reload_inner(false, false);
        std::fs::write(&path, vec![b'#'; crate::config::MAX_FILE_BYTES + 1]).unwrap();
        assert!(matches!(poll(), Err(ReloadError::Read(..))));
        for _ in 0..3 {
            assert_eq!(poll().unwrap(), Reloaded::Unchanged);
        }
        assert_eq!(live.status().reloads_failed, 1);
        assert!(live.status().last_error.is_some(), "still shown");
        // A directory in its place: a new stamp, one more failure.
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        assert!(matches!(poll(), Err(ReloadError::Read(..))));
        assert_eq!(poll().unwrap(), Reloaded::Unchanged);
        assert_eq!(live.status().reloads_failed, 2);
        std::fs::remove_dir(&path).unwrap();
        // A link loop (the 44th attack: still read every poll, its stamp
        // unknown), through two links.
        let other = dir.path().join("other");
        std::os::unix::fs::symlink(&other, &path).unwrap();
        std::os::unix::fs::symlink(&path, &other).unwrap();
        assert!(matches!(poll(), Err(ReloadError::Read(..))));
        for _ in 0..3 {
            assert_eq!(poll().unwrap(), Reloaded::Unchanged);
        }
        assert_eq!(live.status().reloads_failed, 3);
        // Fixed at the far link: the near one is as it was.
        std::fs::remove_file(&other).unwrap();
        std::fs::write(&other, A).unwrap();
        assert_eq!(poll().unwrap(), Reloaded::Changed, "read again");
        assert_eq!(live.status().last_error, None);
        std::fs::remove_file(&other).unwrap();
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, B).unwrap();
        assert_eq!(poll().unwrap(), Reloaded::Changed);
        assert_eq!(limit(&live), 2);
        assert_eq!(live.status().last_error, None);
        // A bad file that can be read is still read at every poll (another
        // file may have given up the domain it asks for), counted once.
        std::fs::write(&path, "domain: d\nrules: [").unwrap();
        assert!(poll().is_err());
        assert_eq!(poll().unwrap(), Reloaded::Unchanged);
        assert_eq!(live.status().reloads_failed, 4);
    }

    /// Made readable again by `chmod` alone (its size and mtime unchanged),
    /// a file is read at the next poll.
    #[test]
    fn a_files_stamp_moves_with_its_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.yaml");
        std::fs::write(&path, A).unwrap();
        let before = FileStamp::of(&path);
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_ne!(FileStamp::of(&path), before);
    }
}
