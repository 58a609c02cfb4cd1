//! Processes a test pauses: stopped and resumed with signals, and waited on until the signal
//! took effect.

use std::time::{Duration, Instant};

/// Whether process `pid` is stopped (state `T` in `/proc/<pid>/stat`: SIGSTOP took effect).
pub fn is_stopped(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_else(|e| panic!("/proc/{pid}/stat: {e}"));
    stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()) == Some("T")
}

/// Sends `signal` (`-STOP`, `-CONT`) to process `pid` and waits until it took effect (stopped,
/// or running again), at most 10 s.
pub fn signal_and_wait(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill").args([signal, &pid.to_string()]).status().expect("run kill");
    assert!(status.success(), "kill {signal} {pid}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while is_stopped(pid) != (signal == "-STOP") {
        assert!(Instant::now() < deadline, "kill {signal} {pid} took no effect in 10 s");
        std::thread::sleep(Duration::from_millis(5));
    }
}
