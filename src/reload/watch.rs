//! The file watch: notify events on a limits file's directory (or a
//! directory of limits files), debounced, with a slow poll behind them in
//! case an event is lost or the directory is made again. The *directory* is
//! watched, so in-place writes, write-then-rename (vim, deploy tools) and
//! Kubernetes ConfigMap `..data` symlink swaps are all seen. It only decides
//! *when* to reload; what a reload does is [`super::file`]'s and
//! [`super::LiveFiles`]'s.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

use super::{LiveFile, LiveFiles};

/// Quiet time after the last file event before the file is read.
const DEBOUNCE: Duration = Duration::from_millis(50);
/// How often the file is checked even without events.
const POLL: Duration = Duration::from_secs(2);

impl LiveFile {
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
                        super::worker::run(move || live.reload_and_log("file changed")).await;
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
                        super::worker::run(move || live.reload_and_log("poll")).await;
                    }
                }
            }
        });
        Ok(WatchGuard { task })
    }
}

impl LiveFiles {
    /// Watches every file (see [`LiveFile::watch`]) and every directory
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
                super::worker::run(move || catalog.rescan(&dir, cause)).await;
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
