//! The `dir` lease store: SPEC §2's layout under a local directory, for one host.
//!
//! Conditional create = write a temp file, fsync it, `link(2)` it onto the final
//! name (fails if the name exists, atomically: readers never see half an object),
//! fsync the directory. `LastModified` is the file's mtime; the store clock is the
//! local clock.

use std::fs;
use std::io::{self, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

use super::{CreateOutcome, LeaseStore, StoreError, StoredObject};
use crate::clock::{Clock, StoreClock};

/// The lease store in a local directory (`kind = "dir"`): a create is a hard link of a
/// fully written file, which fails when the name exists; for one machine, tests and
/// demos.
pub struct DirStore {
    root: PathBuf,
    clock: StoreClock,
}

impl DirStore {
    /// Opens (creating if needed) a store rooted at `root`.
    pub fn open(root: impl Into<PathBuf>, local: Arc<dyn Clock>) -> io::Result<DirStore> {
        let root = root.into();
        fs::create_dir_all(&root)?;
        Ok(DirStore {
            root,
            clock: StoreClock::new(local),
        })
    }

    /// Maps a key to a path under the root; keys that would escape it are refused.
    fn path_of(&self, key: &str) -> Result<PathBuf, StoreError> {
        let rel = Path::new(key);
        let safe = !key.is_empty()
            && rel.components().all(
                |c| matches!(c, Component::Normal(s) if !s.to_string_lossy().starts_with(".tmp-")),
            );
        if !safe {
            return Err(StoreError::Refused(format!(
                "key {key:?} is not a safe relative path"
            )));
        }
        Ok(self.root.join(rel))
    }
}

fn io_err(e: io::Error) -> StoreError {
    StoreError::Unavailable(format!("dir store I/O error: {e}"))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StoreError::Unavailable(format!("dir store task failed: {e}")))?
}

fn create_if_absent_sync(path: &Path, body: &[u8]) -> Result<CreateOutcome, StoreError> {
    let dir = path
        .parent()
        .ok_or_else(|| StoreError::Refused("key has no parent directory".into()))?;
    fs::create_dir_all(dir).map_err(io_err)?;
    let tmp = dir.join(format!(".tmp-{:016x}", crate::entropy::u64()));
    let result = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(body)?;
        f.sync_all()?;
        drop(f);
        match fs::hard_link(&tmp, path) {
            Ok(()) => {
                fs::File::open(dir)?.sync_all()?;
                Ok(CreateOutcome::Created)
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(CreateOutcome::AlreadyExists),
            Err(e) => Err(e),
        }
    })();
    let _ = fs::remove_file(&tmp);
    result.map_err(io_err)
}

#[async_trait]
impl LeaseStore for DirStore {
    async fn list(
        &self,
        prefix: &str,
        start_after: Option<&str>,
    ) -> Result<Vec<String>, StoreError> {
        // Split "a/b/c" into directory "a/b/" and name prefix "c".
        let (dir_key, name_prefix) = match prefix.rfind('/') {
            Some(i) => (&prefix[..=i], &prefix[i + 1..]),
            None => ("", prefix),
        };
        let dir = if dir_key.is_empty() {
            self.root.clone()
        } else {
            self.path_of(dir_key.trim_end_matches('/'))?
        };
        let (dir_key, name_prefix) = (dir_key.to_owned(), name_prefix.to_owned());
        let start_after = start_after.map(str::to_owned);
        blocking(move || {
            let entries = match fs::read_dir(&dir) {
                Ok(it) => it,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
                Err(e) => return Err(io_err(e)),
            };
            let mut keys = Vec::new();
            for entry in entries {
                let entry = entry.map_err(io_err)?;
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with(".tmp-") || !name.starts_with(&name_prefix) {
                    continue;
                }
                let key = format!("{dir_key}{name}");
                if start_after.as_deref().is_none_or(|s| key.as_str() > s) {
                    keys.push(key);
                }
            }
            keys.sort();
            Ok(keys)
        })
        .await
    }

    async fn get(&self, key: &str) -> Result<Option<StoredObject>, StoreError> {
        let path = self.path_of(key)?;
        blocking(move || match fs::read(&path) {
            Ok(body) => {
                let mtime = fs::metadata(&path)
                    .and_then(|m| m.modified())
                    .map_err(io_err)?;
                Ok(Some(StoredObject {
                    body: Bytes::from(body),
                    last_modified: mtime,
                }))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(e)),
        })
        .await
    }

    async fn create_if_absent(&self, key: &str, body: Bytes) -> Result<CreateOutcome, StoreError> {
        let path = self.path_of(key)?;
        blocking(move || create_if_absent_sync(&path, &body)).await
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        let path = self.path_of(key)?;
        blocking(move || match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(e)),
        })
        .await
    }

    fn clock(&self) -> &StoreClock {
        &self.clock
    }

    fn describe(&self) -> String {
        format!("dir store at {}", self.root.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SystemClock;

    #[tokio::test]
    async fn conditional_create_lists_and_reads() {
        let tmp = tempfile::tempdir().unwrap();
        let s = DirStore::open(tmp.path(), Arc::new(SystemClock)).unwrap();
        let k = "p/l/00000000000000000001.json";
        assert_eq!(
            s.create_if_absent(k, Bytes::from_static(b"a"))
                .await
                .unwrap(),
            CreateOutcome::Created
        );
        assert_eq!(
            s.create_if_absent(k, Bytes::from_static(b"b"))
                .await
                .unwrap(),
            CreateOutcome::AlreadyExists
        );
        assert_eq!(&s.get(k).await.unwrap().unwrap().body[..], b"a");
        assert!(s.get("p/l/none.json").await.unwrap().is_none());
        s.create_if_absent("p/l/00000000000000000002.json", Bytes::new())
            .await
            .unwrap();
        assert_eq!(s.list("p/l/", None).await.unwrap().len(), 2);
        assert_eq!(
            s.list("p/l/", Some(k)).await.unwrap(),
            vec!["p/l/00000000000000000002.json".to_string()]
        );
        assert!(s.list("p/other/", None).await.unwrap().is_empty());
        assert!(s.path_of("../escape").is_err());
    }
}
