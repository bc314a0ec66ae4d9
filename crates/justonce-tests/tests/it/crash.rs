//! Real worker processes: killed with SIGKILL at each named point, and racing each other.

use super::{key, on_every_database};
use justonce_tests::{TestBackend, TestDb};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

on_every_database!(
    a_worker_killed_at_any_point_leaves_one_effect,
    two_processes_racing_on_the_same_keys_act_once_per_key,
);

fn worker<DB: TestBackend>(db: &TestDb<DB>, pause_at: &str, keys: &[String]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_crash-worker"))
        .args([&db.url, &db.prefix, "test", pause_at])
        .args(keys)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start crash-worker")
}

/// The lines a worker printed, after it exited successfully.
async fn finish(child: Child) -> Vec<String> {
    let output = tokio::time::timeout(Duration::from_secs(120), child.wait_with_output())
        .await
        .expect("crash-worker hung")
        .expect("wait for crash-worker");
    assert!(
        output.status.success(),
        "crash-worker failed: {:?}",
        output.status
    );
    String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

async fn a_worker_killed_at_any_point_leaves_one_effect<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    for (point, retry_says) in [
        ("after-claim", "processed"),
        ("after-effect", "processed"),
        ("after-commit", "duplicate"),
    ] {
        let id = format!("crash:{point}");
        let mut child = worker(&db, point, std::slice::from_ref(&id));
        let stdout = child.stdout.take().unwrap();
        let line = BufReader::new(stdout).lines().next_line().await.unwrap();
        assert_eq!(line.as_deref(), Some(format!("paused at {point}").as_str()));
        child.kill().await.expect("SIGKILL the worker");

        // The broker redelivers the unacknowledged message to a new worker.
        let retry = finish(worker(&db, "never", std::slice::from_ref(&id))).await;
        assert_eq!(retry, vec![format!("{retry_says} {id}")], "killed {point}");
        assert_eq!(db.effects_of(&key(&id)).await, 1, "killed {point}");
    }
    db.cleanup().await;
}

async fn two_processes_racing_on_the_same_keys_act_once_per_key<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let keys: Vec<String> = (0..200).map(|n| format!("race:{n}")).collect();
    let mut workers = [worker(&db, "go", &keys), worker(&db, "go", &keys)];
    // Both are connected and waiting; release them together so that they really race.
    for worker in &mut workers {
        let stdout = worker.stdout.as_mut().unwrap();
        let mut ready = String::new();
        BufReader::new(stdout).read_line(&mut ready).await.unwrap();
        assert_eq!(ready.trim(), "ready");
    }
    for worker in &mut workers {
        worker
            .stdin
            .as_mut()
            .unwrap()
            .write_all(b"go\n")
            .await
            .unwrap();
    }
    let [one, two] = workers;
    let lines = [finish(one).await, finish(two).await].concat();
    let processed = lines
        .iter()
        .filter(|line| line.starts_with("processed "))
        .count();
    let duplicates = lines
        .iter()
        .filter(|line| line.starts_with("duplicate "))
        .count();
    assert_eq!((processed, duplicates), (200, 200));
    let distinct = DB::count(
        db.inbox.pool(),
        format!("SELECT count(DISTINCT msg_key) FROM {}effects", db.prefix),
    )
    .await;
    assert_eq!((db.rows("effects").await, distinct), (200, 200));
    db.cleanup().await;
}
