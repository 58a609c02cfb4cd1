//! A PostgreSQL server of a test's own, from the distribution's packages (Debian's
//! `/usr/lib/postgresql/N/bin`): initdb into a temporary directory, the server on a Unix socket it
//! creates there, no TCP port at all (`listen_addresses` empty); as the unprivileged user `nobody`
//! when run as root, which PostgreSQL refuses. Used by tests/arbiter.rs and the HA fault driver's
//! arbiter path (tests/torture/ha/arbiter.rs).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The directory of Debian's PostgreSQL server binaries (`/usr/lib/postgresql/N/bin`), newest.
fn postgres_bin() -> PathBuf {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .filter(|(_, bin): &(u32, PathBuf)| bin.join("postgres").is_file() && bin.join("initdb").is_file())
        .collect();
    found.sort();
    found.pop().map(|(_, bin)| bin).unwrap_or_else(|| {
        panic!("no PostgreSQL server in /usr/lib/postgresql/*/bin: install Debian's (apt-get install postgresql; .ci/run does)")
    })
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1).map(|effective| effective == "0"))
        .unwrap_or(false)
}

/// `program args` as the unprivileged user `nobody` when this runs as root (PostgreSQL refuses
/// to run as root), else as this user.
fn unprivileged(program: &Path) -> Command {
    if is_root() {
        let mut cmd = Command::new("setpriv");
        cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"]).arg(program);
        cmd
    } else {
        Command::new(program)
    }
}

/// A PostgreSQL server of the test's own, stopped (SIGTERM: a smart shutdown) when dropped.
pub struct Postgres {
    child: Child,
    socket_dir: PathBuf,
    dir: tempfile::TempDir,
}

impl Postgres {
    pub fn start() -> Postgres {
        let bin = postgres_bin();
        let dir = tempfile::Builder::new().prefix("kf-pg.").tempdir().expect("a temporary directory");
        let (data, socket_dir) = (dir.path().join("data"), dir.path().join("socket"));
        std::fs::create_dir(&socket_dir).expect("socket dir");
        if is_root() {
            let chown = Command::new("chown").args(["-R", "65534:65534"]).arg(dir.path()).status().expect("run chown");
            assert!(chown.success(), "chown the PostgreSQL directory to nobody");
        }
        let initdb = unprivileged(&bin.join("initdb"))
            .args(["--auth=trust", "--username=kf", "--no-sync", "--encoding=UTF8", "--locale=C", "-D"])
            .arg(&data)
            .stdout(Stdio::null())
            .output()
            .expect("run initdb");
        assert!(initdb.status.success(), "initdb failed: {}", String::from_utf8_lossy(&initdb.stderr));
        // No TCP at all (listen_addresses empty): the server creates its Unix socket in socket_dir.
        let child = unprivileged(&bin.join("postgres"))
            .arg("-D")
            .arg(&data)
            .args(["-c", "listen_addresses=", "-c", "fsync=off", "-c", "max_connections=50", "-k"])
            .arg(&socket_dir)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("postgres.log")).expect("log file"))
            .spawn()
            .expect("start postgres");
        Postgres { child, socket_dir, dir }
    }

    pub fn conninfo(&self) -> String {
        format!("host={} user=kf dbname=postgres", self.socket_dir.display())
    }

    /// Waits until the server accepts connections.
    pub async fn wait_ready(&mut self) -> tokio_postgres::Client {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match tokio_postgres::connect(&self.conninfo(), tokio_postgres::NoTls).await {
                Ok((client, connection)) => {
                    tokio::spawn(connection);
                    return client;
                }
                Err(err) => {
                    if let Ok(Some(status)) = self.child.try_wait() {
                        panic!("postgres exited ({status}) before it accepted connections: {}", self.log());
                    }
                    assert!(Instant::now() < deadline, "postgres accepted no connection within 60 s ({err}): {}", self.log());
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !matches!(self.child.try_wait(), Ok(Some(_))) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
