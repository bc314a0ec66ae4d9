//! What operators rely on: JSON logs and the access log, rejections and broker outages
//! logged once, `# HELP` and histograms on `/metrics`, shell completions and the systemd
//! unit.

use super::serve::{
    SECRET, Server, await_keys, client, database, drop_database, post, signature, text_of,
    usage_error,
};
use justonce_tests::{Answer, Sink};
use serde_json::Value;
use std::collections::BTreeSet;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

type Sqlite = justonce_sql::sqlx::Sqlite;

/// Each line parsed as a JSON object; a line that is not one fails the test.
fn parse_lines(lines: &[String]) -> Vec<serde_json::Map<String, Value>> {
    lines
        .iter()
        .map(|line| match serde_json::from_str(line) {
            Ok(Value::Object(object)) => object,
            _ => panic!("not a JSON object: {line:?}"),
        })
        .collect()
}

/// The lines whose message is `message`.
fn with_message<'a>(
    lines: &'a [serde_json::Map<String, Value>],
    message: &str,
) -> Vec<&'a serde_json::Map<String, Value>> {
    lines
        .iter()
        .filter(|line| line["message"] == message)
        .collect()
}

/// Polls `/metrics` until every line of `expected` is there; the last page.
async fn metrics_with(server: &Server, expected: &[String]) -> String {
    let client = client();
    let mut page = String::new();
    for _ in 0..200 {
        page = text_of(&client, &format!("{}/metrics", server.admin)).await;
        if expected.iter().all(|line| page.lines().any(|l| l == line)) {
            return page;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{expected:?} not all in\n{page}");
}

/// Every metric family on the page has a `# HELP` line and a `# TYPE` line.
fn assert_every_metric_described(page: &str) {
    let described: BTreeSet<&str> = page
        .lines()
        .filter_map(|line| line.strip_prefix("# HELP "))
        .filter_map(|rest| rest.split(' ').next())
        .collect();
    let typed: BTreeSet<&str> = page
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split(' ').next())
        .collect();
    let mut families = BTreeSet::new();
    for line in page
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let name = line.split(['{', ' ']).next().unwrap();
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| {
                name.strip_suffix(suffix)
                    .filter(|base| typed.contains(base))
            })
            .unwrap_or(name);
        families.insert(family);
    }
    assert!(families.len() > 10, "{page}");
    for family in families {
        assert!(
            described.contains(family),
            "no # HELP for {family}:\n{page}"
        );
        assert!(typed.contains(family), "no # TYPE for {family}:\n{page}");
    }
}

/// With `server.log_format = "json"` every line `serve` writes is a JSON object with its
/// time, level, target and message; each request gets an access line with its method,
/// path, status, bytes and time, which never holds a body, a signature, a secret or a query
/// string; a delivery that fails and then goes through logs each change once, with its key
/// and destination.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_carry_their_fields_and_the_access_log_no_secret() {
    let (db, url) = database::<Sqlite>("json-logs").await;
    let flaky: justonce_tests::Script = Arc::new(|key: &str, attempt| {
        if key == "demo:evt_flaky" && attempt == 1 {
            Answer::status(503)
        } else {
            Answer::status(200)
        }
    });
    let sink = Sink::scripted(flaky).await;
    let mut server = Server::configure_all(&url, &sink.url(), "log_format = \"json\"", "");
    let logs = server.start_logged(&[], &[("RUST_LOG", "info")]).await;
    let client = client();
    let body = r#"{"id":"evt_flaky","note":"body-marker-7f3a9c"}"#;
    let signed = signature(body);
    for query in ["", "?token=query-marker-5e1d"] {
        let answer = client
            .post(format!("{}/webhooks/demo{query}", server.public))
            .header("x-signature", &signed)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200);
    }
    let forged = format!("sha256={}", "ab".repeat(32));
    let refused = client
        .post(format!("{}/webhooks/demo", server.public))
        .header("x-signature", &forged)
        .body(r#"{"id":"evt_forged","note":"body-marker-7f3a9c"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    // Tried, refused with a 503, tried again and taken.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while sink.requests() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not delivered again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let recorded = [r#"justonce_deliveries_total{outcome="sent",destination="demo"} 1"#.to_owned()];
    metrics_with(&server, &recorded).await;
    server.stop().await;
    let lines = logs.await.unwrap();
    let objects = parse_lines(&lines);
    for line in &objects {
        for field in ["time", "level", "target", "message"] {
            assert!(line[field].is_string(), "no {field} in {line:?}");
        }
    }
    let access = objects
        .iter()
        .filter(|line| line["target"] == "justonce::access")
        .collect::<Vec<_>>();
    let posts: Vec<_> = access
        .iter()
        .filter(|line| line["method"] == "POST" && line["path"] == "/webhooks/demo")
        .collect();
    assert_eq!(posts.len(), 3, "{access:?}");
    let statuses: Vec<_> = posts.iter().map(|line| line["status"].clone()).collect();
    assert_eq!(statuses, [200, 200, 401]);
    for line in posts {
        assert!(line["bytes"].as_u64().is_some_and(|b| b > 0), "{line:?}");
        assert!(line["millis"].as_f64().is_some(), "{line:?}");
    }
    let all = lines.join("\n");
    for secret in [
        "body-marker-7f3a9c",
        "query-marker-5e1d",
        signed.as_str(),
        &signed["sha256=".len()..],
        forged.as_str(),
        SECRET,
    ] {
        assert!(!all.contains(secret), "{secret:?} was logged:\n{all}");
    }
    let failing = with_message(&objects, "delivery failing: retrying later");
    assert_eq!(failing.len(), 1, "{all}");
    assert_eq!(failing[0]["level"], "WARN");
    assert_eq!(failing[0]["key"], "demo:evt_flaky");
    assert_eq!(failing[0]["destination"], "demo");
    assert!(
        failing[0]["reason"].as_str().unwrap().contains("503"),
        "{all}"
    );
    let recovered = with_message(&objects, "delivered after failing");
    assert_eq!(recovered.len(), 1, "{all}");
    assert_eq!(recovered[0]["key"], "demo:evt_flaky");
    assert_eq!(recovered[0]["destination"], "demo");
    drop_database(db, &url).await;
}

/// Rejected webhooks are logged at most once per source and kind each 10 s, with how many
/// were left out since, and never with their signature.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_webhooks_are_logged_once_per_kind_and_interval() {
    let (db, url) = database::<Sqlite>("rejection-logs").await;
    let mut server = Server::configure(&url, "http://127.0.0.1:1/unused");
    let logs = server.start_logged(&["--log-format", "json"], &[]).await;
    let client = client();
    let forged = format!("sha256={}", "cd".repeat(32));
    let forge = || {
        client
            .post(format!("{}/webhooks/demo", server.public))
            .header("x-signature", &forged)
            .body(r#"{"id":"evt_1"}"#)
            .send()
    };
    for _ in 0..5 {
        assert_eq!(forge().await.unwrap().status(), 401);
    }
    for _ in 0..3 {
        let unknown = client
            .post(format!("{}/webhooks/nobody", server.public))
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(unknown.status(), 404);
    }
    let no_id = post(&client, &server.public, r#"{"no":"id"}"#)
        .await
        .unwrap();
    assert_eq!(no_id.0, 400);
    tokio::time::sleep(Duration::from_millis(10_500)).await;
    assert_eq!(forge().await.unwrap().status(), 401);
    server.stop().await;
    let lines = logs.await.unwrap();
    let objects = parse_lines(&lines);
    let rejected: Vec<_> = with_message(&objects, "webhook rejected")
        .into_iter()
        .map(|line| {
            (
                line["source"].as_str().unwrap().to_owned(),
                line["kind"].as_str().unwrap().to_owned(),
                line["left_out"].as_u64().unwrap(),
                line["level"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let line = |source: &str, kind: &str, left_out| {
        (
            source.to_owned(),
            kind.to_owned(),
            left_out,
            "WARN".to_owned(),
        )
    };
    assert_eq!(
        rejected,
        [
            line("demo", "rejected_signature", 0),
            line("", "unknown_source", 0),
            line("demo", "rejected_id", 0),
            line("demo", "rejected_signature", 4),
        ],
        "{lines:#?}"
    );
    let all = lines.join("\n");
    assert!(
        !all.contains(&forged[7..]),
        "the signature was logged: {all}"
    );
    drop_database(db, &url).await;
}

/// A bad `server.log_format` or `--log-format` exits 2 and names the setting; with JSON
/// logs, a bad setting is reported as a JSON line.
#[tokio::test]
async fn a_bad_log_format_exits_2_naming_the_setting() {
    let (db, url) = database::<Sqlite>("bad-log-format").await;
    let server = Server::configure(&url, "http://127.0.0.1:1/unused");
    let stderr = usage_error(
        server
            .command(&["check"])
            .env("JUSTONCE_SERVER_LOG_FORMAT", "yaml"),
    )
    .await;
    assert!(
        stderr.contains("server.log_format (from JUSTONCE_SERVER_LOG_FORMAT)")
            && stderr.contains(r#""yaml" is not "text" or "json""#),
        "{stderr}"
    );
    let stderr = usage_error(&mut server.command(&["check", "--log-format", "yaml"])).await;
    assert!(stderr.contains("--log-format"), "{stderr}");
    // With JSON logs, the reason a command stops is a JSON line too.
    let output = server
        .command(&["check", "--log-format", "json"])
        .env("JUSTONCE_SERVER_BODY_LIMIT", "0")
        .stderr(Stdio::piped())
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let lines: Vec<String> = String::from_utf8_lossy(&output.stderr)
        .lines()
        .map(str::to_owned)
        .collect();
    let objects = parse_lines(&lines);
    assert_eq!(objects.len(), 1, "{lines:?}");
    assert_eq!(objects[0]["level"], "ERROR");
    assert!(
        objects[0]["message"]
            .as_str()
            .unwrap()
            .contains("server.body_limit (from JUSTONCE_SERVER_BODY_LIMIT)"),
        "{lines:?}"
    );
    drop_database(db, &url).await;
}

/// Every metric on `/metrics` has `# HELP`; the receiver's time to 2xx and the relay's
/// commit-to-delivered histograms count each event posted and delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_is_described_and_the_histograms_count_each_event() {
    let (db, url) = database::<Sqlite>("metrics-help").await;
    let sink = Sink::start().await;
    let mut server = Server::configure(&url, &sink.url());
    server.start().await;
    let client = client();
    let before = text_of(&client, &format!("{}/metrics", server.admin)).await;
    assert!(
        !before.contains("justonce_webhook_seconds_count"),
        "{before}"
    );
    for n in 0..5 {
        let body = format!(r#"{{"id":"evt_{n}"}}"#);
        assert_eq!(post(&client, &server.public, &body).await.unwrap().0, 200);
    }
    // A rejection, for its counter.
    let unsigned = client
        .post(format!("{}/webhooks/demo", server.public))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(unsigned.status(), 401);
    await_keys(&sink, 5).await;
    let expected = [
        r#"justonce_webhook_seconds_count{source="demo"} 5"#.to_owned(),
        r#"justonce_delivery_seconds_count{destination="demo"} 5"#.to_owned(),
        // Every answer within the longest bucket.
        r#"justonce_webhook_seconds_bucket{source="demo",le="+Inf"} 5"#.to_owned(),
        r#"justonce_delivery_seconds_bucket{destination="demo",le="259200"} 5"#.to_owned(),
        "justonce_store_up 1".to_owned(),
    ];
    let page = metrics_with(&server, &expected).await;
    assert!(
        page.contains("# TYPE justonce_webhook_seconds histogram")
            && page.contains("# TYPE justonce_delivery_seconds histogram"),
        "{page}"
    );
    assert_every_metric_described(&page);
    server.stop().await;
    drop_database(db, &url).await;
}

/// A consumer whose broker cannot be reached logs one line when it goes down and one when
/// it is back, not one per retry; its messages are counted under its name, and its gauge
/// says it is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_is_logged_once_each_way() {
    use redis::AsyncCommands;
    let (db, url) = database::<Sqlite>("broker-outage").await;
    let sink = Sink::start().await;
    let redis_url = justonce_tests::redis_url();
    let upstream = redis_url
        .trim_start_matches("redis://")
        .rsplit('@')
        .next()
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_owned();
    let stream = format!("{}orders", db.prefix);
    let mut redis = redis::Client::open(redis_url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("Redis");
    for n in 0..3 {
        let _: String = redis
            .xadd(
                &stream,
                "*",
                &[("order_id", format!("order-{n}")), ("body", format!("{n}"))],
            )
            .await
            .unwrap();
    }
    // The consumer reaches Redis through a port where nothing listens yet.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let consumer = format!(
        "[consumers.orders]\nfrom = \"redis://127.0.0.1:{port}\"\nstream = \"{stream}\"\n\
         id = \"header:order_id\"\ntarget = \"{}\"\n",
        sink.url()
    );
    let mut server = Server::configure_with(&url, &sink.url(), &consumer);
    let logs = server
        .start_logged(&[], &[("JUSTONCE_LOG_FORMAT", "json")])
        .await;
    let down = [r#"justonce_consumer_up{consumer="orders"} 0"#.to_owned()];
    metrics_with(&server, &down).await;
    // Three tries at least, 5 s apart.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let proxy = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let forwarding = tokio::spawn(async move {
        loop {
            let (mut client, _) = proxy.accept().await.unwrap();
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let mut server = tokio::net::TcpStream::connect(upstream).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
            });
        }
    });
    let by_key = await_keys(&sink, 3).await;
    assert_eq!(by_key.len(), 3, "every message reached the target");
    // The relay records its deliveries after the target has them: waited for too.
    let up = [
        r#"justonce_consumer_up{consumer="orders"} 1"#.to_owned(),
        r#"justonce_deliveries_consumed_total{consumer="orders",broker="redis"} 3"#.to_owned(),
        r#"justonce_deliveries_total{outcome="sent",destination="orders"} 3"#.to_owned(),
    ];
    let page = metrics_with(&server, &up).await;
    assert_every_metric_described(&page);
    server.stop().await;
    forwarding.abort();
    let _: () = redis.del(&stream).await.unwrap();
    let lines = logs.await.unwrap();
    let objects = parse_lines(&lines);
    let all = lines.join("\n");
    let troubles: Vec<_> = objects
        .iter()
        .filter(|line| line["level"] == "WARN" || line["level"] == "ERROR")
        .collect();
    assert_eq!(troubles.len(), 1, "one line for the outage:\n{all}");
    assert!(
        troubles[0]["message"]
            .as_str()
            .unwrap()
            .starts_with("not consuming"),
        "{all}"
    );
    assert_eq!(troubles[0]["consumer"], "orders");
    assert!(troubles[0]["error"].as_str().is_some(), "{all}");
    let back = with_message(&objects, "consuming again");
    assert_eq!(back.len(), 1, "{all}");
    assert_eq!(back[0]["consumer"], "orders");
    drop_database(db, &url).await;
}

/// A RabbitMQ broker that refuses the consumer's login at start stops `serve` with exit 2,
/// naming the consumer and the broker's answer: a setting to fix, not a broker to wait for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_refused_at_start_stops_serve_with_exit_2() {
    let (db, url) = database::<Sqlite>("login-refused").await;
    let broker = super::serve::amqp_url().replacen("guest:guest@", "guest:wrong@", 1);
    let consumer = format!(
        "[consumers.orders]\nfrom = \"{broker}\"\nqueue = \"{}orders\"\n\
         target = \"http://127.0.0.1:1/x\"\n",
        db.prefix
    );
    let server = Server::configure_with(&url, "http://127.0.0.1:1/x", &consumer);
    let stderr = super::serve::serve_exits_2_at_start(&server, &[]).await;
    assert!(
        stderr.contains(
            "consumers.orders: invalid configuration: the broker refused access (ACCESS_REFUSED"
        ),
        "{stderr}"
    );
    drop_database(db, &url).await;
}

/// A RabbitMQ broker that is down at every retry gets one line, naming the consumer and
/// the cause, also under `RUST_LOG=warn`; the AMQP client's own errors at each retry are
/// not logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_down_at_every_retry_is_logged_once() {
    let (db, url) = database::<Sqlite>("broker-refusing").await;
    let broker = format!(
        "amqp://guest:guest@127.0.0.1:{}/%2f",
        super::serve::free_port()
    );
    let consumer = format!(
        "[consumers.orders]\nfrom = \"{broker}\"\nqueue = \"{}orders\"\n\
         target = \"http://127.0.0.1:1/x\"\n",
        db.prefix
    );
    let mut server = Server::configure_with(&url, "http://127.0.0.1:1/x", &consumer);
    let logs = server
        .start_logged(&["--log-format", "json"], &[("RUST_LOG", "warn")])
        .await;
    // Three tries at least, 5 s apart.
    tokio::time::sleep(Duration::from_secs(11)).await;
    server.stop().await;
    let lines = logs.await.unwrap();
    let all = lines.join("\n");
    let troubles: Vec<_> = parse_lines(&lines)
        .into_iter()
        .filter(|line| line["level"] == "WARN" || line["level"] == "ERROR")
        .collect();
    assert_eq!(troubles.len(), 1, "one line for the broker down:\n{all}");
    assert_eq!(troubles[0]["consumer"], "orders");
    assert!(
        troubles[0]["error"]
            .as_str()
            .unwrap()
            .contains("Connection refused"),
        "{all}"
    );
    drop_database(db, &url).await;
}

/// `justonce completions bash` and `zsh` print scripts that name every subcommand, with no
/// configuration file.
#[tokio::test]
async fn completions_name_every_subcommand() {
    for shell in ["bash", "zsh"] {
        let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_justonce"))
            .args([
                "--config",
                "/nonexistent/justonce.toml",
                "completions",
                shell,
            ])
            .output()
            .await
            .unwrap();
        assert!(output.status.success(), "{output:?}");
        let script = String::from_utf8(output.stdout).unwrap();
        for command in [
            "serve",
            "migrate",
            "check",
            "purge",
            "stats",
            "dlq",
            "keys",
            "bench",
            "completions",
            "--log-format",
        ] {
            assert!(script.contains(command), "{shell}: no {command}");
        }
    }
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_justonce"))
        .args(["completions", "tcsh"])
        .output()
        .await
        .unwrap();
    assert_eq!(
        output.status.code(),
        Some(2),
        "an unknown shell is a usage error"
    );
}

/// `deploy/justonce.service` passes `systemd-analyze verify`, with its binary at the path
/// the unit names replaced by the one under test.
#[test]
fn the_systemd_unit_verifies() {
    let unit = include_str!("../../../../deploy/justonce.service");
    let installed = "/usr/local/bin/justonce";
    assert!(unit.contains(&format!("ExecStart={installed} ")), "{unit}");
    let folder = std::env::temp_dir().join(format!("justonce-unit-{}", std::process::id()));
    std::fs::create_dir_all(&folder).unwrap();
    let path = folder.join("justonce.service");
    std::fs::write(
        &path,
        unit.replace(installed, env!("CARGO_BIN_EXE_justonce")),
    )
    .unwrap();
    let output = std::process::Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .unwrap_or_else(|error| {
            panic!("systemd-analyze cannot run ({error}): install the systemd package")
        });
    std::fs::remove_dir_all(&folder).unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(!stderr.contains("justonce.service"), "{stderr}");
}
