//! Live limits: every limits file (and directory of files) named by
//! `--config`, watched, and the [`Catalog`] in force built from their last
//! good versions.
//!
//! [`file`] keeps one file live (watch, debounce, hash, swap in only a good
//! changed version); this module keeps the set: directories rescanned as
//! files come and go, every file validated beside the others exactly as at
//! start-up (two files never declare one domain unless merged), and after
//! every change one new immutable [`Catalog`] swapped in for the surfaces.

mod file;
mod watch;
mod worker;

pub use file::{LiveFile, ReloadError, ReloadStatus, Reloaded};
pub use watch::WatchGuard;
pub(crate) use worker::run as in_background;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use crate::config::{self, ConfigError, Limits};
use crate::limits::{Catalog, SharedCatalog};

/// A file, the domain it declares, and its last good limits.
type DomainOf = (PathBuf, String, Arc<ArcSwap<Limits>>);

type Callback = Arc<dyn Fn() + Send + Sync>;

/// What the files hold together: the domain each declares (so a reload is
/// validated as start-up is: two files sharing a domain would share counter
/// keys, and one rule's expiry would wipe the other's history), and the
/// catalog published from them.
struct InForce {
    /// Each file's path, its domain, and its last good limits, in
    /// `--config` order.
    by_file: Mutex<Vec<DomainOf>>,
    merge: bool,
    /// What the surfaces read.
    catalog: SharedCatalog,
    /// Publishes one at a time, each from the latest limits.
    publishing: Mutex<()>,
    /// Held while a directory's files are reloaded one by one: the catalog
    /// is published once they all are, so two files swapping domains in
    /// one deploy never leave a domain unserved in between.
    hold: Mutex<Hold>,
    /// Run after every published change (e.g. to drop caches).
    callbacks: Mutex<Vec<Callback>>,
}

/// Who holds publishing, and whether a change waits for them.
#[derive(Default)]
struct Hold {
    holders: usize,
    pending: bool,
}

/// Publishing held until dropped (also on a panic in between).
struct Held<'a>(&'a InForce);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let publish = {
            let mut hold = self.0.hold.lock().unwrap_or_else(|e| e.into_inner());
            hold.holders = hold.holders.saturating_sub(1);
            hold.holders == 0 && std::mem::take(&mut hold.pending)
        };
        if publish {
            self.0.publish();
        }
    }
}

impl InForce {
    /// Builds a catalog of every file's last good limits and swaps it in,
    /// or, while held, once the last holder lets go.
    fn publish(&self) {
        {
            let mut hold = self.hold.lock().unwrap_or_else(|e| e.into_inner());
            if hold.holders > 0 {
                hold.pending = true;
                return;
            }
        }
        {
            let _one = self.publishing.lock().unwrap_or_else(|e| e.into_inner());
            let files = self
                .by_file
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .map(|(_, _, active)| active.load_full())
                .collect();
            self.catalog.store(Arc::new(Catalog::new(files)));
        }
        let callbacks: Vec<Callback> = self.callbacks.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for f in callbacks {
            f();
        }
    }

    /// Holds publishing while several files reload; a change meanwhile
    /// is published when the returned guard is dropped.
    fn hold(&self) -> Held<'_> {
        self.hold.lock().unwrap_or_else(|e| e.into_inner()).holders += 1;
        Held(self)
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

/// Every limits file tollgate serves, each live, and the catalog in force
/// built from them. A `--config` path may be a directory: every `.yaml`,
/// `.yml` and `.json` file in it is served, and files added to or removed
/// from it while running add or drop their domains (envoyproxy/ratelimit's
/// runtime directory).
pub struct LiveFiles {
    /// What `--config` named, files and directories.
    sources: Vec<PathBuf>,
    files: ArcSwap<Vec<Arc<LiveFile>>>,
    in_force: Arc<InForce>,
    /// Why each file of a directory is kept out, so it is said once.
    refused: Mutex<HashMap<PathBuf, String>>,
}

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

/// A refusal a rescan pass met, said once the pass proves to be the last.
enum Refusal {
    /// A served file's reload failed (begun at the instant given).
    Reload(Arc<LiveFile>, std::time::Instant, ReloadError),
    /// A file new to the directory is kept out, for this reason.
    Admit(String),
}

/// Passes of one rescan while the directory keeps changing under it; past
/// them the next watch event or poll reads it again.
const MAX_PASSES: usize = 5;

/// What identifies the version of every file of a directory, unread.
fn stamps_in(dir: &Path) -> Option<Vec<(PathBuf, Option<file::FileStamp>)>> {
    let files = files_in(dir).ok()?;
    Some(
        files
            .into_iter()
            .map(|p| {
                let stamp = file::FileStamp::of(&p);
                (p, stamp)
            })
            .collect(),
    )
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

/// Whether `path` is a link whose target does not exist.
fn leads_nowhere(path: &Path) -> bool {
    path.symlink_metadata().is_ok_and(|m| m.file_type().is_symlink())
        && std::fs::metadata(path).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
}

impl LiveFiles {
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
        let mut files: Vec<Arc<LiveFile>> = Vec::with_capacity(paths.len());
        let mut taken: Vec<DomainOf> = Vec::with_capacity(paths.len());
        for path in &paths {
            let live = Arc::new(LiveFile::load(path)?);
            let limits = live.active().load_full();
            if let Some(reason) = InForce::conflict(&taken, merge, None, &limits) {
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
        let in_force = Arc::new(InForce {
            by_file: Mutex::new(taken),
            merge,
            catalog: Catalog::default().shared(),
            publishing: Mutex::new(()),
            hold: Mutex::new(Hold::default()),
            callbacks: Mutex::new(Vec::new()),
        });
        in_force.publish();
        for f in &files {
            Self::attach(f, &in_force);
        }
        Ok(LiveFiles {
            sources: sources.to_vec(),
            files: ArcSwap::from_pointee(files),
            in_force,
            refused: Mutex::new(HashMap::new()),
        })
    }

    /// Ties a file to the domain checks, and its changes to publishing;
    /// from here it is served.
    fn attach(file: &Arc<LiveFile>, in_force: &Arc<InForce>) {
        crate::metrics::get().file_served(&file.path.display().to_string(), &file.status().version);
        let _ = file.in_force.set(in_force.clone());
        let publish = in_force.clone();
        file.on_change(move || publish.publish());
    }

    /// The catalog in force, swapped whole on every change: what surfaces read.
    pub fn catalog(&self) -> SharedCatalog {
        self.in_force.catalog.clone()
    }

    /// The files served now, in `--config` order (a directory's by name).
    pub fn files(&self) -> Arc<Vec<Arc<LiveFile>>> {
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

    /// Brings a directory's files in line with what it holds now: new ones
    /// are loaded (a bad one is kept out, with its error said once), gone
    /// ones dropped with their domain, the others reloaded.
    fn rescan(&self, dir: &Path, cause: &str) {
        // From the first file touched to the last: a file admitted below
        // is in force only with the rest of the rescan, in its place.
        let _held = self.in_force.hold();
        // Files are read one after another, so a volume swapped between two
        // reads (a ConfigMap's `..data`) would put one file's old version
        // beside another's new one: two files exchanging domains would leave
        // one unserved. The pass is repeated until nothing changed while it
        // ran, so what is published is one version of the directory.
        // A refusal met in one pass may be such a mix too (a file clashing
        // with its neighbour's next version): refusals are said once the
        // last pass is known, each file's latest one.
        let mut refusals = HashMap::new();
        for _ in 0..MAX_PASSES {
            let before = stamps_in(dir);
            self.rescan_once(dir, cause, &mut refusals);
            if stamps_in(dir) == before {
                break;
            }
            tracing::debug!(dir = %dir.display(), "the limits directory changed while it was read; reading it again");
        }
        for (path, refusal) in refusals {
            match refusal {
                Refusal::Reload(f, started, error) => {
                    if matches!(error, ReloadError::Clash(_)) {
                        f.refuse(&error);
                    }
                    f.log(cause, started, Err(error));
                }
                Refusal::Admit(reason) => {
                    let mut refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
                    if refused.get(&path) != Some(&reason) {
                        tracing::error!(cause, "{reason}; not served until fixed");
                        crate::metrics::get().reload(&path.display().to_string(), false);
                        refused.insert(path, reason);
                    }
                }
            }
        }
    }

    /// One pass of [`LiveFiles::rescan`], under its hold: successes are
    /// said at once, refusals left in `refusals` by file.
    fn rescan_once(&self, dir: &Path, cause: &str, refusals: &mut HashMap<PathBuf, Refusal>) {
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
        let mut next: Vec<Arc<LiveFile>> = Vec::with_capacity(on_disk.len());
        for f in current.iter() {
            let from_dir = f.path.starts_with(dir) && !self.sources.contains(&f.path);
            // A link left leading nowhere (its ConfigMap key gone, its
            // target deleted) is the file gone: its domain is let go, and
            // the link is refused below as any new one would be. Kept, its
            // last limits would hold the domain against a file on disk.
            if from_dir && (!on_disk.contains(&f.path) || leads_nowhere(&f.path)) {
                let domain = f.active().load().domain.clone();
                self.in_force
                    .by_file
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .retain(|(p, _, _)| *p != f.path);
                tracing::info!(cause, file = %f.path.display(), %domain, "limits file removed; its limits no longer apply");
                crate::metrics::get().forget_file(&f.path.display().to_string());
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
                    refusals.remove(path);
                    self.refused.lock().unwrap_or_else(|e| e.into_inner()).remove(path);
                    let limits = live.active().load_full();
                    tracing::info!(cause, file = %path.display(), domain = %limits.domain, rules = limits.rules.len(), index_ms = %millis(limits.index.built_in()), "limits file added");
                    next.push(live);
                    changed = true;
                }
                Err(reason) => {
                    refusals.insert(path.clone(), Refusal::Admit(reason));
                }
            }
        }
        self.refused.lock().unwrap_or_else(|e| e.into_inner()).retain(|p, _| {
            let kept = on_disk.contains(p);
            if !kept {
                crate::metrics::get().forget_file(&p.display().to_string());
            }
            kept
        });
        if changed {
            // Keep `--config` order: sources first, a directory's files by name.
            let order = |f: &Arc<LiveFile>| {
                let i = self
                    .sources
                    .iter()
                    .position(|s| f.path.starts_with(s))
                    .unwrap_or(usize::MAX);
                (i, f.path.clone())
            };
            next.sort_by_key(order);
            // HTTP rules apply in file order: the catalog keeps it.
            self.in_force
                .by_file
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .sort_by_key(|(p, _, _)| next.iter().position(|f| f.path == *p));
            self.files.store(Arc::new(next.clone()));
        }
        if changed {
            self.in_force.publish();
        }
        for f in next.iter().filter(|f| on_disk.contains(&f.path)) {
            let started = std::time::Instant::now();
            match f.reload_deferring_clash(cause) {
                Err(error) => {
                    refusals.insert(f.path.clone(), Refusal::Reload(f.clone(), started, error));
                }
                // A later pass that finds the file unchanged leaves an
                // earlier pass's refusal standing: it is still the state.
                Ok(Reloaded::Unchanged) if refusals.contains_key(&f.path) => {}
                Ok(done) => {
                    refusals.remove(&f.path);
                    f.log(cause, started, Ok(done));
                }
            }
        }
    }

    /// Loads a file that appeared in a directory and puts it in force,
    /// unless it is invalid or its domain clashes.
    fn admit(&self, path: &Path) -> Result<Arc<LiveFile>, String> {
        let live = Arc::new(LiveFile::load(path).map_err(|e| e.to_string())?);
        let limits = live.active().load_full();
        let mut taken = self.in_force.by_file.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(reason) = InForce::conflict(&taken, self.in_force.merge, None, &limits) {
            return Err(format!("{}: {reason}", path.display()));
        }
        taken.push((path.to_path_buf(), limits.domain.clone(), live.active()));
        drop(taken);
        Self::attach(&live, &self.in_force);
        Ok(live)
    }

    /// Runs `f` after every change to the catalog in force.
    pub fn on_change(&self, f: impl Fn() + Send + Sync + 'static) {
        self.in_force
            .callbacks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::new(f));
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
}

/// A duration as milliseconds with one decimal, for log lines.
pub(crate) fn millis(d: std::time::Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e3)
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "domain: d\nrules:\n  - name: r\n    limits: [{requests: 1, per: 1s}]\n";
    const B: &str = "domain: d\nrules:\n  - name: r\n    limits: [{requests: 2, per: 1s}]\n";

    #[test]
    fn a_reload_cannot_take_another_files_domain() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.yaml");
        let b = dir.path().join("b.yaml");
        std::fs::write(&a, A).unwrap();
        std::fs::write(&b, A.replace("domain: d", "domain: e")).unwrap();
        let files = LiveFiles::load(&[a.clone(), b.clone()], false).unwrap();
        let catalog = files.catalog();
        std::fs::write(&b, B).unwrap();
        let err = files.files()[1].reload().unwrap_err();
        assert!(err.to_string().contains("already declared by"), "{err}");
        // Read again at every poll (the other file may let the domain go),
        // the same refusal is one failed reload, not one a poll.
        for _ in 0..3 {
            files.files()[1].reload_and_log("poll");
        }
        assert_eq!(files.files()[1].status().reloads_failed, 1);
        assert_eq!(
            catalog.load().domain("e").unwrap().rules[0].windows[0].requests,
            1,
            "nothing changed"
        );
        assert_eq!(catalog.load().domain("d").unwrap().rules[0].windows[0].requests, 1);
        // Renaming a's domain frees "d" for b.
        std::fs::write(&a, A.replace("domain: d", "domain: f")).unwrap();
        files.files()[0].reload().unwrap();
        assert_eq!(files.files()[1].reload().unwrap(), Reloaded::Changed);
        assert_eq!(catalog.load().domain("d").unwrap().rules[0].windows[0].requests, 2);
        // Two files swapping domains in one deploy: valid on disk, so both load.
        std::fs::write(&a, B).unwrap();
        std::fs::write(&b, A.replace("domain: d", "domain: f")).unwrap();
        files.reload_all("test");
        assert_eq!(catalog.load().domain("d").unwrap().rules[0].windows[0].requests, 2);
        assert_eq!(catalog.load().domain("f").unwrap().rules[0].windows[0].requests, 1);
        assert!(files.files().iter().all(|f| f.status().last_error.is_none()));
    }

    #[test]
    fn a_change_while_held_is_published_when_the_last_holder_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.yaml");
        std::fs::write(&a, A).unwrap();
        let files = LiveFiles::load(std::slice::from_ref(&a), false).unwrap();
        let published = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = published.clone();
        files.on_change(move || {
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        });
        let requests = || files.catalog().load().domain("d").unwrap().rules[0].windows[0].requests;
        let (one, two) = (files.in_force.hold(), files.in_force.hold());
        std::fs::write(&a, B).unwrap();
        assert_eq!(files.files()[0].reload().unwrap(), Reloaded::Changed);
        assert_eq!(requests(), 1, "held: not yet in force");
        drop(one);
        assert_eq!(requests(), 1, "still held by another rescan");
        assert_eq!(published.load(std::sync::atomic::Ordering::SeqCst), 0);
        drop(two);
        assert_eq!(requests(), 2, "in force once the last holder lets go");
        assert_eq!(published.load(std::sync::atomic::Ordering::SeqCst), 1, "published once");
    }
}
