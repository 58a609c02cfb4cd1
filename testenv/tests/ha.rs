//! HA mode: three etcd members and two API servers in namespaces of their own really form one
//! cluster, a write through A is read through B, a cut etcd member does not stop writes, a cut
//! majority does, healing brings them back, and stopping leaves no namespace behind.
//!
//! Needs root (network namespaces). Timings are printed, never asserted: each step waits for a
//! condition.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use kube_fence_testenv::ha::{HaCluster, HaOptions, NS_PREFIX, Partition, Place, Source};

fn kubectl(bin: &Path, kubeconfig: &Path, args: &[&str]) -> Output {
    Command::new(bin.join("kubectl"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["--request-timeout", "5s"])
        .args(args)
        .output()
        .expect("run kubectl")
}

fn ok(out: &Output) -> bool {
    out.status.success()
}

/// Retries `f` until it holds (a bounded wait for a condition, never a bare sleep); returns how long it took.
fn eventually(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    start.elapsed()
}

fn our_namespaces() -> Vec<String> {
    std::fs::read_dir("/run/netns")
        .map(|rd| rd.filter_map(|e| e.ok()).filter_map(|e| e.file_name().into_string().ok()).filter(|n| n.starts_with(NS_PREFIX)).collect())
        .unwrap_or_default()
}

#[test]
fn ha_writes_through_a_are_read_through_b_and_survive_a_cut_member() {
    let mut ha = HaCluster::start(HaOptions::default()).expect("the HA control plane starts");
    let bin = ha.bin_dir.clone();
    let [a, b] = ha.kubeconfigs.clone();
    let dir = ha.dir().to_path_buf();

    // One cluster: what A writes, B reads.
    assert!(ok(&kubectl(&bin, &a, &["create", "configmap", "ha-1", "--from-literal=v=1"])));
    let took = eventually("B reads A's write", Duration::from_secs(30), || {
        String::from_utf8_lossy(&kubectl(&bin, &b, &["get", "configmap", "ha-1", "-o", "jsonpath={.data.v}"]).stdout) == "1"
    });
    eprintln!("figure: B read A's write after {:.2}s", took.as_secs_f64());

    // One member cut off: the other two are a majority, writes still commit through both.
    let member = ha.etcd_leader().expect("a leader");
    ha.partition(Partition::EtcdIsolated { member }).expect("isolate the leader");
    let took = eventually("a write commits through A with the old leader cut off", Duration::from_secs(60), || {
        ok(&kubectl(&bin, &a, &["create", "configmap", "ha-2", "--from-literal=v=2"]))
            || ok(&kubectl(&bin, &a, &["get", "configmap", "ha-2"]))
    });
    eprintln!("figure: first write after isolating the etcd leader m{}: {:.2}s", member + 1, took.as_secs_f64());
    eventually("B reads it", Duration::from_secs(30), || ok(&kubectl(&bin, &b, &["get", "configmap", "ha-2"])));
    let leader = ha.etcd_leader();
    assert!(leader.is_some_and(|l| l != member), "a new leader among the two others: {leader:?}");
    ha.heal().expect("heal");
    eventually("the cut member is healthy again", Duration::from_secs(60), || ha.etcd_healthy(member));

    // API server A cut from two of the three members: the third forwards to the leader over the
    // peer links, so A's writes still commit (after its etcd client gives up the cut ones).
    let follower = (0..3).find(|m| Some(*m) != ha.etcd_leader()).expect("a follower");
    let majority: Vec<usize> = (0..3).filter(|m| *m != follower).collect();
    ha.partition(Partition::ApiFromEtcd { api: 0, members: majority.clone() }).expect("cut A from two members");
    let took = eventually("A writes through the one member it reaches", Duration::from_secs(90), || {
        ok(&kubectl(&bin, &a, &["create", "configmap", "ha-3", "--from-literal=v=3"]))
            || ok(&kubectl(&bin, &a, &["get", "configmap", "ha-3"]))
    });
    eprintln!("figure: A cut from etcd {majority:?} (reaches m{}): first write after {:.2}s", follower + 1, took.as_secs_f64());
    ha.heal().expect("heal");

    // API server A cut from every member: its writes fail (genuinely), B's still commit; healed,
    // A writes again.
    ha.partition(Partition::ApiFromEtcd { api: 0, members: vec![0, 1, 2] }).expect("cut A from etcd");
    assert!(ok(&kubectl(&bin, &b, &["create", "configmap", "ha-4", "--from-literal=v=4"])), "B writes while A is cut");
    assert!(!ok(&kubectl(&bin, &a, &["create", "configmap", "ha-5", "--from-literal=v=5"])), "A cannot commit without etcd");
    ha.heal().expect("heal");
    let took = eventually("A writes again after the heal", Duration::from_secs(90), || {
        ok(&kubectl(&bin, &a, &["create", "configmap", "ha-5", "--from-literal=v=5"]))
            || ok(&kubectl(&bin, &a, &["get", "configmap", "ha-5"]))
    });
    eprintln!("figure: A cut from all of etcd: first write {:.2}s after the heal", took.as_secs_f64());

    // The workers cut from A: A unreachable for them, kube-fence's path to A still open.
    ha.partition(Partition::ClientFromApi { api: 0, source: Source::Workers }).expect("cut the workers from A");
    assert!(!ok(&kubectl(&bin, &a, &["get", "configmap", "ha-1"])), "the workers cannot reach A");
    assert!(ok(&kubectl(&bin, &ha.fence_kubeconfigs[0], &["get", "configmap", "ha-1"])), "kube-fence still reaches A");
    ha.heal().expect("heal");
    eventually("the workers reach A again", Duration::from_secs(30), || ok(&kubectl(&bin, &a, &["get", "configmap", "ha-1"])));

    // API server B killed and started again.
    ha.kill("kube-apiserver-b").expect("kill B");
    assert!(!ha.api_ready(1));
    ha.start_again("kube-apiserver-b").expect("start B again");
    let took = eventually("B serves again", Duration::from_secs(120), || ha.api_ready(1));
    eprintln!("figure: kube-apiserver B ready {:.2}s after its restart", took.as_secs_f64());
    assert!(ok(&kubectl(&bin, &b, &["get", "configmap", "ha-5"])));
    assert_eq!(Place::Api(1).ns(), "kfha-b");

    ha.stop();
    assert!(our_namespaces().is_empty(), "stop removes every namespace: {:?}", our_namespaces());
    assert!(!dir.exists(), "stop removes the state directory");
}
