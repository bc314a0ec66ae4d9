//! Lease holders as real processes, paused with SIGSTOP and killed with SIGKILL, on every
//! lease store: the store's clock decides when a key may be taken over, and the fencing
//! token keeps a stale holder from overwriting the new one's result.

use super::{LeaseStore, on_every_lease_store};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

on_every_lease_store!(
    a_worker_paused_past_its_lease_cannot_overwrite_the_new_holder,
    a_worker_killed_mid_lease_is_taken_over_after_expiry_not_before,
);

/// A `lease-worker` process on one key of the test's store.
struct Worker {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Worker {
    fn start<S: LeaseStore>(store: &S, lease: Duration, result: &str) -> Self {
        let [url, prefix] = store.location();
        let mut child = Command::new(env!("CARGO_BIN_EXE_lease-worker"))
            .args([
                &url,
                &prefix,
                "charge:1",
                &lease.as_millis().to_string(),
                result,
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start lease-worker");
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Self { child, lines }
    }

    async fn says(&mut self) -> String {
        let line = tokio::time::timeout(Duration::from_secs(30), self.lines.next_line())
            .await
            .expect("the worker answers within 30 s")
            .unwrap();
        line.expect("the worker printed a line")
    }

    /// Tells the worker to complete its key.
    async fn go(&mut self) {
        let stdin = self.child.stdin.as_mut().unwrap();
        stdin.write_all(b"go\n").await.unwrap();
        stdin.flush().await.unwrap();
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.id().unwrap().to_string();
        let status = std::process::Command::new("kill")
            .args([signal, &pid])
            .status()
            .unwrap();
        assert!(status.success(), "kill {signal}");
    }

    async fn exit_code(mut self) -> Option<i32> {
        self.child.wait().await.unwrap().code()
    }
}

async fn a_worker_paused_past_its_lease_cannot_overwrite_the_new_holder<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let lease = Duration::from_millis(500);
    let mut paused = Worker::start(&store, lease, "first");
    assert_eq!(paused.says().await, "acquired 1");
    paused.signal("-STOP");
    tokio::time::sleep(lease + Duration::from_millis(200)).await;

    let mut successor = Worker::start(&store, Duration::from_secs(60), "second");
    assert_eq!(successor.says().await, "acquired 2", "the lease ran out");
    successor.go().await;
    assert_eq!(successor.says().await, "completed");
    assert_eq!(successor.exit_code().await, Some(0));

    paused.signal("-CONT");
    paused.go().await;
    assert_eq!(
        paused.says().await,
        "lost",
        "the resumed worker is fenced off"
    );
    assert_eq!(paused.exit_code().await, Some(3));

    let mut reader = Worker::start(&store, lease, "third");
    assert_eq!(
        reader.says().await,
        "done second",
        "the second worker's result stands"
    );
    store.close().await;
}

async fn a_worker_killed_mid_lease_is_taken_over_after_expiry_not_before<S: LeaseStore>(
    test: &str,
) {
    let store = S::open(test).await;
    let lease = Duration::from_secs(3);
    let mut killed = Worker::start(&store, lease, "first");
    assert_eq!(killed.says().await, "acquired 1");
    let acquired = Instant::now();
    killed.signal("-KILL");
    assert_eq!(killed.exit_code().await, None, "killed by a signal");

    let mut early = Worker::start(&store, lease, "early");
    let said = early.says().await;
    assert!(
        acquired.elapsed() < lease,
        "the check ran within the lease; it took {:?}",
        acquired.elapsed()
    );
    assert_eq!(
        said, "in-progress",
        "not taken over before the lease runs out"
    );

    tokio::time::sleep((lease + Duration::from_millis(200)).saturating_sub(acquired.elapsed()))
        .await;
    let mut late = Worker::start(&store, lease, "second");
    assert_eq!(late.says().await, "acquired 2", "taken over after expiry");
    late.go().await;
    assert_eq!(late.says().await, "completed");
    store.close().await;
}
