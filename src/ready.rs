//! The ready file (`--ready-file PATH` of `kube-fence webhook` and `kube-fence controller`): once
//! a process has bound its ports it writes where they are, so a script or a test that asked for
//! port 0 learns the port the kernel gave, and nobody picks a port first and binds it later.
//!
//! The file is written atomically (complete or absent) and removed on exit. Its format is one
//! `key=value` line per port the process serves, the value an `ip:port` address:
//!
//! ```text
//! webhook=127.0.0.1:40123
//! ```
//!
//! - `webhook`: the fencing webhook's HTTPS port (`/validate`, `/writer/…`, `/metrics`,
//!   `/healthz`, `/readyz`), written by `kube-fence webhook` and `kube-fence run`;
//! - `metrics`: the plain-HTTP port of `/metrics`, `/healthz` and `/readyz`, written by
//!   `kube-fence controller`, and by `kube-fence webhook` and `kube-fence run` given
//!   `--metrics-addr`.
//!
//! A reader ignores keys it does not know (a later version may add some). `kube-fence run
//! --local --ready-file` writes the webhook's URL alone, as it always has.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Where a process serves: the contents of its ready file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ready {
    /// The fencing webhook's HTTPS address.
    pub webhook: Option<SocketAddr>,
    /// The plain-HTTP address of `/metrics`, `/healthz` and `/readyz`.
    pub metrics: Option<SocketAddr>,
}

/// Why a ready file could not be read. A message leaves its source out: the chain of causes tells
/// it ([`crate::telemetry::Chain`]).
#[derive(Debug, thiserror::Error)]
pub enum ReadyFileError {
    #[error("cannot read the ready file {}", .path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("line {line} of the ready file is not `key=value`: {text:?}")]
    NotKeyValue { line: usize, text: String },
    #[error("`{key}` of the ready file is not an ip:port address: {value:?}")]
    NotAnAddress {
        key: &'static str,
        value: String,
        #[source]
        source: std::net::AddrParseError,
    },
    #[error("`{key}` appears twice in the ready file")]
    Repeated { key: &'static str },
}

const WEBHOOK: &str = "webhook";
const METRICS: &str = "metrics";

impl Ready {
    /// The file's contents: a line per address that is set.
    pub fn render(&self) -> String {
        [(WEBHOOK, self.webhook), (METRICS, self.metrics)]
            .into_iter()
            .filter_map(|(key, addr)| addr.map(|addr| format!("{key}={addr}\n")))
            .collect()
    }

    /// Reads what [`Ready::render`] wrote.
    pub fn parse(text: &str) -> Result<Ready, ReadyFileError> {
        let mut ready = Ready::default();
        for (index, line) in text.lines().enumerate() {
            let Some((key, value)) = line.split_once('=') else {
                return Err(ReadyFileError::NotKeyValue { line: index + 1, text: line.to_string() });
            };
            let (key, slot) = match key.trim() {
                WEBHOOK => (WEBHOOK, &mut ready.webhook),
                METRICS => (METRICS, &mut ready.metrics),
                _ => continue,
            };
            let value = value.trim();
            let addr = value.parse().map_err(|source| ReadyFileError::NotAnAddress { key, value: value.to_string(), source })?;
            if slot.replace(addr).is_some() {
                return Err(ReadyFileError::Repeated { key });
            }
        }
        Ok(ready)
    }

    /// Reads the ready file at `path`: `None` while it does not exist (the process is not ready
    /// yet). Written atomically, it is never seen half-written.
    pub fn read(path: &Path) -> Result<Option<Ready>, ReadyFileError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Ready::parse(&text).map(Some),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(ReadyFileError::Read { path: path.to_path_buf(), source }),
        }
    }

    /// Writes the ready file at `path`, atomically.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        write_atomically(path, &self.render())
    }
}

/// Writes `contents` to `path` atomically: to a temporary file beside it, then renamed, so a
/// reader that sees the file sees all of it.
pub fn write_atomically(path: &Path, contents: &str) -> std::io::Result<()> {
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(format!(".{}.tmp", std::process::id()));
    let temporary = PathBuf::from(temporary);
    std::fs::write(&temporary, contents)?;
    std::fs::rename(&temporary, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&temporary);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> Option<SocketAddr> {
        Some(s.parse().unwrap_or_else(|e| panic!("{s}: {e}")))
    }

    #[test]
    fn what_is_written_reads_back() {
        for ready in [
            Ready { webhook: addr("127.0.0.1:40123"), metrics: None },
            Ready { webhook: None, metrics: addr("[::1]:8080") },
            Ready { webhook: addr("0.0.0.0:8443"), metrics: addr("127.0.0.1:9") },
            Ready::default(),
        ] {
            assert_eq!(Ready::parse(&ready.render()).ok(), Some(ready), "{:?}", ready.render());
        }
        assert_eq!(
            Ready { webhook: addr("127.0.0.1:1"), metrics: addr("127.0.0.1:2") }.render(),
            "webhook=127.0.0.1:1\nmetrics=127.0.0.1:2\n"
        );
    }

    #[test]
    fn unknown_keys_are_ignored_and_anything_else_malformed_is_refused() {
        assert_eq!(Ready::parse("future=1\nwebhook=127.0.0.1:5\n").ok(), Some(Ready { webhook: addr("127.0.0.1:5"), metrics: None }));
        let refused = |text: &str| Ready::parse(text).err().map(|e| e.to_string()).unwrap_or_else(|| panic!("{text:?} parsed"));
        assert_eq!(refused("https://127.0.0.1:5\n"), "line 1 of the ready file is not `key=value`: \"https://127.0.0.1:5\"");
        assert!(refused("webhook=localhost:5\n").starts_with("`webhook` of the ready file is not an ip:port address"));
        assert!(refused("metrics=127.0.0.1\n").starts_with("`metrics` of the ready file is not an ip:port address"));
        assert_eq!(refused("webhook=127.0.0.1:5\nwebhook=127.0.0.1:6\n"), "`webhook` appears twice in the ready file");
    }

    #[test]
    fn the_file_appears_whole_leaves_no_temporary_behind_and_is_absent_until_written() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let path = dir.path().join("ready");
        assert_eq!(Ready::read(&path).ok(), Some(None));
        let ready = Ready { webhook: addr("127.0.0.1:1234"), metrics: None };
        ready.write(&path).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(Ready::read(&path).ok(), Some(Some(ready)));
        let names: Vec<_> = std::fs::read_dir(dir.path()).into_iter().flatten().flatten().map(|e| e.file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("ready")]);
        assert!(ready.write(&dir.path().join("no-such-dir/ready")).is_err());
    }

    #[test]
    fn a_file_that_cannot_be_read_is_named_and_its_io_error_is_the_source() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let Err(err) = Ready::read(dir.path()) else { panic!("a directory is not a ready file") };
        // The message names what failed; the I/O error is the source, said by the chain alone.
        assert_eq!(err.to_string(), format!("cannot read the ready file {}", dir.path().display()));
        assert!(std::error::Error::source(&err).is_some_and(|source| source.is::<std::io::Error>()), "{err:?}");
    }
}
