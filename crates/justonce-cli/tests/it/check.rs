//! `justonce check` with a target: what it refuses as bad usage, and a target that refuses
//! every try. Its runs against real consumers are in the integration suite, beside the
//! examples and brokers they check.
//!
//! `justonce check` without a target against the real brokers: it reaches each configured
//! consumer's broker, names each consumer whose broker fails, and leaves a running
//! consumer's session alone.

use super::serve::{Server, client, database, drop_database, free_port, run_capturing};
use std::process::Output;
use std::time::{Duration, Instant};

type Sqlite = justonce_sql::sqlx::Sqlite;

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

/// The configuration of consumer `name` on the broker at `url`, reading a queue, stream or
/// topic named with `prefix`, as its own MQTT client.
fn consumer(name: &str, url: &str, prefix: &str) -> String {
    let from = match url.split_once("://").map(|(scheme, _)| scheme) {
        Some("amqp") => "queue",
        Some("nats" | "redis") => "stream",
        Some("mqtt") => "topic",
        other => panic!("no broker has the scheme {other:?}"),
    };
    let client_id = if from == "topic" {
        format!("client_id = \"{prefix}{name}\"\n")
    } else {
        String::new()
    };
    format!(
        "[consumers.{name}]\nfrom = \"{url}\"\n{from} = \"{prefix}{name}\"\n{client_id}\
         target = \"http://127.0.0.1:1/x\"\n"
    )
}

/// A consumer on each of the four brokers, as the test servers take them.
fn reachable(prefix: &str) -> String {
    [
        consumer("rabbit", &justonce_tests::amqp_url(), prefix),
        consumer("nats", &justonce_tests::nats_url(), prefix),
        consumer("redis", &justonce_tests::redis_url(), prefix),
        consumer("mqtt", &justonce_tests::mqtt_url(), prefix),
    ]
    .concat()
}

/// A consumer on each of the four brokers: `check` connects to each and passes, counting
/// them.
#[tokio::test]
async fn check_reaches_the_broker_of_every_consumer() {
    let (db, url) = database::<Sqlite>("check-brokers").await;
    let server = Server::configure_with(&url, "http://127.0.0.1:1/x", &reachable(&db.prefix));
    assert_eq!(run_capturing(&server, &["migrate"]).await.0, 0);
    let (code, stdout, stderr) = run_capturing(&server, &["check"]).await;
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.contains("1 source, 4 consumers, 4 brokers reached"),
        "{stdout}"
    );
    drop_database(db, &url).await;
}

/// A Kafka consumer: `check` asks its brokers for the topic's metadata, and counts them
/// reached.
#[tokio::test]
async fn check_reaches_the_kafka_brokers_of_a_consumer() {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let (db, url) = database::<Sqlite>("check-kafka").await;
    let kafka = justonce_tests::kafka_url();
    let topic = format!("{}orders", db.prefix);
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", kafka.trim_start_matches("kafka://"))
        .create()
        .unwrap();
    let new = NewTopic::new(&topic, 1, TopicReplication::Fixed(1));
    for created in admin
        .create_topics([&new], &AdminOptions::new())
        .await
        .expect("Kafka")
    {
        created.unwrap();
    }
    let consumer = format!(
        "[consumers.orders]\nfrom = \"{kafka}\"\ntopic = \"{topic}\"\nid = \"header:ce_id\"\n\
         target = \"http://127.0.0.1:1/x\"\n"
    );
    let server = Server::configure_with(&url, "http://127.0.0.1:1/x", &consumer);
    assert_eq!(run_capturing(&server, &["migrate"]).await.0, 0);
    let (code, stdout, stderr) = run_capturing(&server, &["check"]).await;
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.contains("1 source, 1 consumer, 1 broker reached"),
        "{stdout}"
    );
    admin
        .delete_topics(&[&topic], &AdminOptions::new())
        .await
        .unwrap();
    drop_database(db, &url).await;
}

/// A NATS server of the test's own, without JetStream, on a free port; stopped when dropped.
async fn nats_without_jetstream() -> (tokio::process::Child, String) {
    let port = free_port();
    let server = tokio::process::Command::new("nats-server")
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("nats-server");
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "nats-server did not listen");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (server, format!("nats://127.0.0.1:{port}"))
}

/// Beside the four that reach their brokers, a consumer refused by RabbitMQ, one whose
/// password Redis does not have, one on a NATS server without JetStream, and one each on a
/// closed NATS and MQTT port: `check` exits 2 (a refused login is a setting to fix) with one
/// line for each of the five, naming the consumer, its URL without the password and the
/// cause, and none for the others.
#[tokio::test]
async fn check_names_each_consumer_whose_broker_fails() {
    let (db, url) = database::<Sqlite>("check-brokers-fail").await;
    let (_plain_nats, plain_nats) = nats_without_jetstream().await;
    let amqp = justonce_tests::amqp_url();
    let refused = amqp.replacen("guest:guest@", "guest:wrong-password@", 1);
    assert_ne!(refused, amqp, "the RabbitMQ URL logs in as guest:guest");
    let redis = justonce_tests::redis_url().replacen("redis://", "redis://:wrong-password@", 1);
    let failing = [
        ("rabbit_refused", refused, "guest:***@", "ACCESS_REFUSED"),
        (
            "redis_refused",
            redis,
            "redis://:***@",
            "authentication failed",
        ),
        ("nats_plain", plain_nats, "nats://127.0.0.1:", "JetStream"),
        (
            "nats_closed",
            format!("nats://127.0.0.1:{}", free_port()),
            "nats://127.0.0.1:",
            "refused",
        ),
        (
            "mqtt_closed",
            format!("mqtt://127.0.0.1:{}", free_port()),
            "mqtt://127.0.0.1:",
            "refused",
        ),
    ];
    let mut config = reachable(&db.prefix);
    for (name, broker, _, _) in &failing {
        config.push_str(&consumer(name, broker, &db.prefix));
    }
    let server = Server::configure_with(&url, "http://127.0.0.1:1/x", &config);
    assert_eq!(run_capturing(&server, &["migrate"]).await.0, 0);
    let started = Instant::now();
    let (code, stdout, stderr) = run_capturing(&server, &["check"]).await;
    let took = started.elapsed();
    assert_eq!(code, 2, "{stdout}{stderr}");
    let lines: Vec<&str> = stderr
        .lines()
        .map(|line| line.trim_start_matches("justonce: "))
        .filter(|line| line.starts_with("consumer "))
        .collect();
    assert_eq!(lines.len(), failing.len(), "{stderr}");
    for (name, _, shown, cause) in &failing {
        let line = lines
            .iter()
            .find(|line| line.starts_with(&format!("consumer {name}: ")))
            .unwrap_or_else(|| panic!("{name} is not named: {stderr}"));
        assert!(line.contains(shown) && line.contains(cause), "{line}");
    }
    assert!(!stderr.contains("wrong-password"), "{stderr}");
    assert!(!stdout.contains("reached"), "{stdout}");
    // The probes run at once, each within its time limit.
    assert!(took < Duration::from_secs(15), "check took {took:?}");
    drop_database(db, &url).await;
}

/// `check` while `serve` consumes an MQTT topic on its persistent session: the check
/// connects as a client of its own, so the service's consumer is never taken over and
/// stays connected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_leaves_a_running_mqtt_consumer_connected() {
    let (db, url) = database::<Sqlite>("check-mqtt-session").await;
    let config = consumer("mqtt", &justonce_tests::mqtt_url(), &db.prefix);
    let mut server = Server::configure_with(&url, "http://127.0.0.1:1/x", &config);
    let log = server.start_logged(&[], &[]).await;
    let client = client();
    let ready = || async {
        let answer = client.get(format!("{}/readyz", server.admin)).send().await;
        answer.unwrap().status().as_u16()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while ready().await != 200 {
        assert!(Instant::now() < deadline, "the consumer never connected");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (code, stdout, stderr) = run_capturing(&server, &["check"]).await;
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("1 broker reached"), "{stdout}");
    // A taken-over session would close the service's connection within milliseconds.
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_secs(2) {
        assert_eq!(ready().await, 200, "the check disturbed the consumer");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.stop().await;
    let lines = log.await.unwrap();
    assert!(
        !lines.iter().any(|line| line.contains("not consuming")),
        "{lines:#?}"
    );
    drop_database(db, &url).await;
}

/// A consumer of each broker on a port that takes connections and never answers: `check`
/// gives each up after its few seconds, at the same time, and names all four.
#[tokio::test]
async fn check_gives_up_on_brokers_that_never_answer() {
    let (db, url) = database::<Sqlite>("check-brokers-silent").await;
    // The kernel completes the handshakes; nothing ever reads or writes.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let config = [
        consumer(
            "rabbit",
            &format!("amqp://guest:guest@127.0.0.1:{port}/%2f"),
            &db.prefix,
        ),
        consumer("nats", &format!("nats://127.0.0.1:{port}"), &db.prefix),
        consumer("redis", &format!("redis://127.0.0.1:{port}"), &db.prefix),
        consumer("mqtt", &format!("mqtt://127.0.0.1:{port}"), &db.prefix),
    ]
    .concat();
    let server = Server::configure_with(&url, "http://127.0.0.1:1/x", &config);
    assert_eq!(run_capturing(&server, &["migrate"]).await.0, 0);
    let started = Instant::now();
    let (code, stdout, stderr) = run_capturing(&server, &["check"]).await;
    let took = started.elapsed();
    assert_eq!(code, 1, "{stdout}{stderr}");
    for name in ["rabbit", "nats", "redis", "mqtt"] {
        let line = stderr
            .lines()
            .find(|line| line.contains(&format!("consumer {name}: ")))
            .unwrap_or_else(|| panic!("{name} is not named: {stderr}"));
        // The probe's limit, or the client's own connection timeout of the same length.
        let line = line.to_lowercase();
        assert!(
            ["no answer within 5 s", "timeout", "timed out"]
                .iter()
                .any(|cause| line.contains(cause)),
            "{line}"
        );
    }
    assert!(took < Duration::from_secs(10), "check took {took:?}");
    drop(silent);
    drop_database(db, &url).await;
}
