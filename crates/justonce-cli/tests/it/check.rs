//! `justonce check` with a target: what it refuses as bad usage, and a target that refuses
//! every try. Its runs against real consumers are in the integration suite, beside the
//! examples and brokers they check.

use std::process::Output;

async fn check(args: &[&str]) -> Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_justonce"))
        .arg("--config")
        // An empty configuration: a file named by --config must exist.
        .arg("/dev/null")
        .arg("check")
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .unwrap()
}

#[tokio::test]
async fn bad_usage_exits_2_and_says_what_is_missing() {
    let cases: [(&[&str], &str); 6] = [
        (&["http://127.0.0.1:1/x"], "needs --effects or --count"),
        (&["amqp://127.0.0.1", "--effects", "SELECT 1"], "needs --to"),
        (
            &["ftp://127.0.0.1/x", "--effects", "SELECT 1"],
            "expected an http(s), amqp",
        ),
        (
            &["http://127.0.0.1:1/x", "--to", "q", "--effects", "SELECT 1"],
            "--to names a broker",
        ),
        (&["--events", "5"], "--run"),
        (
            &["--run", "true", "--keys", "a,b,a", "--effects", "SELECT 1"],
            "names \"a\" twice",
        ),
    ];
    for (args, expected) in cases {
        let output = check(args).await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

/// Nothing listens on port 1: every try is refused, and the check fails naming them.
#[tokio::test]
async fn a_target_that_refuses_every_try_fails_the_check() {
    let output = check(&[
        "http://127.0.0.1:1/orders",
        "--effects",
        "SELECT 'none' WHERE 1 = 0",
        "--database",
        "sqlite::memory:",
        "--events",
        "3",
        "--delay",
        "0s",
        "--wait",
        "1s",
    ])
    .await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("tries taken: 0 of 6"), "{stdout}");
    assert_eq!(stdout.matches("  refused: event ").count(), 6, "{stdout}");
    assert!(
        stdout.contains("effects: 0 events with one, 3 with none, 0 with more than one"),
        "{stdout}"
    );
}
