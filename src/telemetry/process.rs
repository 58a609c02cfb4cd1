//! The process metrics every Prometheus client library exposes (`process_cpu_seconds_total`,
//! `process_resident_memory_bytes`, `process_virtual_memory_bytes`, `process_open_fds`,
//! `process_max_fds`, `process_start_time_seconds`), read from `/proc/self` at each scrape, as the
//! Go client's procfs collector reads them. prometheus-client has no such collector; on a system
//! without `/proc` the collector exposes nothing.

use std::path::Path;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// What `/proc` says about one process.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProcessStats {
    /// User and system CPU time.
    pub cpu_seconds: f64,
    pub resident_memory_bytes: u64,
    pub virtual_memory_bytes: u64,
    /// Open file descriptors.
    pub open_fds: u64,
    /// The soft limit of open file descriptors (`None`: unlimited).
    pub max_fds: Option<u64>,
    /// Since the Unix epoch.
    pub start_time_seconds: f64,
}

/// Why `/proc` could not be read as expected.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    #[error("cannot read {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not as expected: {what}")]
    Malformed { path: String, what: &'static str },
}

/// The clock's ticks per second and the page size, which `/proc/<pid>/stat` counts in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Units {
    pub ticks_per_second: u64,
    pub page_size: u64,
}

impl Units {
    /// This system's.
    pub fn of_this_system() -> Units {
        Units { ticks_per_second: rustix::param::clock_ticks_per_second(), page_size: rustix::param::page_size() as u64 }
    }
}

/// Reads the stats of the process whose directory is `pid_dir` (`/proc/self`), `proc_stat` being
/// the system's `/proc/stat` (its boot time).
pub fn read(pid_dir: &Path, proc_stat: &Path, units: Units) -> Result<ProcessStats, ProcError> {
    let text = |path: &Path| std::fs::read_to_string(path).map_err(|source| ProcError::Read { path: path.display().to_string(), source });
    let stat_path = pid_dir.join("stat");
    let stat = parse_stat(&text(&stat_path)?)
        .ok_or_else(|| ProcError::Malformed { path: stat_path.display().to_string(), what: "fewer than 24 fields" })?;
    let boot_time = parse_boot_time(&text(proc_stat)?)
        .ok_or_else(|| ProcError::Malformed { path: proc_stat.display().to_string(), what: "no btime line" })?;
    let limits_path = pid_dir.join("limits");
    let max_fds = parse_max_open_files(&text(&limits_path)?)
        .ok_or_else(|| ProcError::Malformed { path: limits_path.display().to_string(), what: "no Max open files line" })?;
    let fd_dir = pid_dir.join("fd");
    let open_fds = std::fs::read_dir(&fd_dir)
        .map_err(|source| ProcError::Read { path: fd_dir.display().to_string(), source })?
        .filter(|entry| entry.is_ok())
        .count() as u64;
    let ticks = units.ticks_per_second.max(1) as f64;
    Ok(ProcessStats {
        cpu_seconds: (stat.utime + stat.stime) as f64 / ticks,
        resident_memory_bytes: stat.rss_pages.saturating_mul(units.page_size),
        virtual_memory_bytes: stat.vsize,
        open_fds,
        max_fds,
        start_time_seconds: boot_time as f64 + stat.start_ticks as f64 / ticks,
    })
}

/// This process's stats.
pub fn read_self() -> Result<ProcessStats, ProcError> {
    read(Path::new("/proc/self"), Path::new("/proc/stat"), Units::of_this_system())
}

/// The fields of `/proc/<pid>/stat` the metrics need (proc(5)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stat {
    utime: u64,
    stime: u64,
    start_ticks: u64,
    vsize: u64,
    rss_pages: u64,
}

/// Parses `/proc/<pid>/stat`. The command name (field 2) is in parentheses and may hold spaces
/// and parentheses itself: the fields are counted after its last `)`.
fn parse_stat(text: &str) -> Option<Stat> {
    let after = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // fields[0] is field 3 (state): field n is fields[n - 3].
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok());
    Some(Stat { utime: field(14)?, stime: field(15)?, start_ticks: field(22)?, vsize: field(23)?, rss_pages: field(24)? })
}

/// The boot time (`btime`, seconds since the epoch) of `/proc/stat`.
fn parse_boot_time(text: &str) -> Option<u64> {
    text.lines().find_map(|line| line.strip_prefix("btime ")).and_then(|v| v.trim().parse().ok())
}

/// The soft limit of `Max open files` in `/proc/<pid>/limits`: `Some(None)` when unlimited.
fn parse_max_open_files(text: &str) -> Option<Option<u64>> {
    let line = text.lines().find_map(|line| line.strip_prefix("Max open files"))?;
    match line.split_whitespace().next()? {
        "unlimited" => Some(None),
        soft => soft.parse().ok().map(Some),
    }
}

/// The collector registered into every kube-fence registry ([`super::registry`]).
#[derive(Debug, Default)]
pub struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // Nothing rather than zeros where /proc cannot be read: a zero would be a lie.
        let Ok(stats) = read_self() else { return Ok(()) };
        let cpu = ConstCounter::new(stats.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            cpu.metric_type(),
        )?)?;
        let gauges: [(&str, &str, f64); 4] = [
            ("process_resident_memory_bytes", "Resident memory size in bytes", stats.resident_memory_bytes as f64),
            ("process_virtual_memory_bytes", "Virtual memory size in bytes", stats.virtual_memory_bytes as f64),
            ("process_open_fds", "Number of open file descriptors", stats.open_fds as f64),
            ("process_start_time_seconds", "Start time of the process since the Unix epoch in seconds", stats.start_time_seconds),
        ];
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        if let Some(max) = stats.max_fds {
            let gauge = ConstGauge::new(max as f64);
            gauge.encode(encoder.encode_descriptor(
                "process_max_fds",
                "Maximum number of open file descriptors",
                None,
                gauge.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_last_parenthesis() {
        // A command name with a space and a parenthesis, as a process may name itself.
        let line = "4242 (kube (fence) x) S 1 4242 4242 0 -1 4194560 1200 0 0 0 250 75 0 0 20 0 9 0 123456 987654321 2048 \
                    18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        let stat = parse_stat(line).expect("parses");
        assert_eq!(stat, Stat { utime: 250, stime: 75, start_ticks: 123456, vsize: 987654321, rss_pages: 2048 });
        assert_eq!(parse_stat("12 (short) S 1 2"), None, "too few fields");
        assert_eq!(parse_stat("no parenthesis"), None);
    }

    #[test]
    fn boot_time_and_the_open_files_limit() {
        assert_eq!(parse_boot_time("cpu  1 2 3\nintr 5\nbtime 1767225600\nprocesses 9\n"), Some(1_767_225_600));
        assert_eq!(parse_boot_time("cpu 1\n"), None);
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max processes             63652                63652                processes \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(parse_max_open_files(limits), Some(Some(1024)));
        assert_eq!(parse_max_open_files(&limits.replace(" 1024 ", " unlimited ")), Some(None));
        assert_eq!(parse_max_open_files("Max processes 1 1 processes\n"), None);
    }

    /// A fake `/proc`, whole, read as the live one is.
    #[test]
    fn a_process_directory_is_read_in_the_units_given() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pid = dir.path().join("self");
        std::fs::create_dir_all(pid.join("fd")).expect("fd dir");
        for fd in ["0", "1", "2", "7"] {
            std::fs::write(pid.join("fd").join(fd), "").expect("fd");
        }
        std::fs::write(pid.join("stat"), "1 (kf) S 0 1 1 0 -1 0 0 0 0 0 300 100 0 0 20 0 1 0 5000 4096 10 0 0").expect("stat");
        std::fs::write(pid.join("limits"), "Max open files            65536                65536                files\n").expect("limits");
        std::fs::write(dir.path().join("stat"), "btime 1000\n").expect("proc stat");
        let stats = read(&pid, &dir.path().join("stat"), Units { ticks_per_second: 100, page_size: 4096 }).expect("reads");
        assert_eq!(
            stats,
            ProcessStats {
                cpu_seconds: 4.0,
                resident_memory_bytes: 40960,
                virtual_memory_bytes: 4096,
                open_fds: 4,
                max_fds: Some(65536),
                start_time_seconds: 1050.0,
            }
        );
        std::fs::remove_file(dir.path().join("stat")).expect("remove");
        let err = read(&pid, &dir.path().join("stat"), Units { ticks_per_second: 100, page_size: 4096 }).expect_err("no /proc/stat");
        assert!(err.to_string().starts_with("cannot read "), "{err}");
    }

    /// This very process, read live: the figures move as the process does.
    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_is_read_live() {
        let before = read_self().expect("/proc/self");
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs_f64();
        assert!(before.start_time_seconds <= now + 1.0 && before.start_time_seconds > now - 3600.0, "{before:?} at {now}");
        assert!(before.resident_memory_bytes > 1 << 20 && before.virtual_memory_bytes >= before.resident_memory_bytes, "{before:?}");
        assert!(before.max_fds.is_none_or(|max| max >= before.open_fds), "{before:?}");
        // Ten more open files are ten more descriptors (other test threads open and close some
        // too: tried a few times).
        let grew = (0..5).any(|_| {
            let before = read_self().expect("/proc/self").open_fds;
            let files: Vec<std::fs::File> = (0..10).map(|_| std::fs::File::open("/proc/self/stat").expect("open")).collect();
            let opened = read_self().expect("/proc/self").open_fds;
            drop(files);
            opened >= before + 10
        });
        assert!(grew, "ten open files never showed as ten more descriptors");
        // Work is on the CPU clock: spin until a quarter second of it shows (a busy machine may
        // give this thread little of each second; 30 s at most).
        let start = std::time::Instant::now();
        let mut x = 0u64;
        let after = loop {
            for _ in 0..1_000_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
            let now = read_self().expect("/proc/self");
            if now.cpu_seconds >= before.cpu_seconds + 0.25 {
                break now;
            }
            assert!(start.elapsed() < std::time::Duration::from_secs(30), "{} then {} (x={x})", before.cpu_seconds, now.cpu_seconds);
        };
        assert_eq!(after.start_time_seconds, before.start_time_seconds);
    }
}
