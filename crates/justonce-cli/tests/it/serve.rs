use hmac::Mac;
use justonce_tests::{Sink, TestBackend, TestDb, peak_rss_mib};
use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;
use tokio::process::{Child, Command};

pub(crate) const SECRET: &str = "the demo signing secret";

on_every_database!(
    every_event_posted_twice_is_delivered_once_per_key,
    a_queue_consumed_by_the_service_reaches_its_target_once_per_key,
    a_stream_consumed_by_the_service_reaches_its_target_once_per_key,
    a_redis_stream_consumed_by_the_service_reaches_its_target_once_per_key,
    an_mqtt_topic_consumed_by_the_service_reaches_its_target_once_per_key,
    a_kafka_topic_consumed_by_the_service_reaches_its_target_once_per_key,
    the_printed_migrations_make_a_schema_the_service_accepts,
    purge_deletes_only_keys_past_retention_and_reports_its_progress,
    serve_purges_keys_past_retention_on_its_schedule,
    keys_release_lets_the_next_claim_take_a_stuck_lease_at_once,
    keys_complete_marks_a_stuck_lease_done_and_refuses_its_holder,
    keys_release_and_complete_change_nothing_unless_confirmed_on_a_lease_in_progress,
    stats_json_reports_exactly_what_the_store_holds,
);

// The fault harness kills the service ten times on every database
// (`harness::a_server_killed_ten_times_*`); this run of twenty kills is the same proof
// through the binary alone and runs on PostgreSQL.
mod postgres_only {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_server_killed_twenty_times_loses_no_acknowledged_event() {
        super::a_server_killed_twenty_times_loses_no_acknowledged_event::<
            justonce_sql::sqlx::Postgres,
        >("a_server_killed_twenty_times_loses_no_acknowledged_event")
        .await
    }
}

/// A `justonce serve` with its own config file, database and free ports.
pub(crate) struct Server {
    config: PathBuf,
    pub(crate) public: String,
    pub(crate) admin: String,
    child: Option<Child>,
    /// The soft and hard limit of open files `serve` starts with, when set.
    pub(crate) open_files: Option<u64>,
}

/// A port nothing listens on: below the range the kernel hands out for port 0, so that no
/// server another test starts meanwhile can take it, as it can a port [`free_port`] found
/// free and let go.
pub(crate) const CLOSED_PORT: u16 = 1;

pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Server {
    pub(crate) fn configure(database: &str, target: &str) -> Self {
        Self::configure_with(database, target, "")
    }

    /// A server whose configuration ends with `more`, such as a consumer.
    pub(crate) fn configure_with(database: &str, target: &str, more: &str) -> Self {
        Self::configure_all(database, target, "", more)
    }

    /// A server with `server` among its `[server]` settings and `more` at the end.
    pub(crate) fn configure_all(database: &str, target: &str, server: &str, more: &str) -> Self {
        let (public, admin) = (free_port(), free_port());
        let config = std::env::temp_dir().join(format!("justonce-{public}.toml"));
        std::fs::write(
            &config,
            format!(
                r#"
[server]
listen = "127.0.0.1:{public}"
admin_listen = "127.0.0.1:{admin}"
database = "{database}"
body_limit = "64KiB"
{server}

[sources.demo]
scheme = "hmac-sha256"
secrets = ["env:DEMO_SECRET"]
id = "json:/id"
target = "{target}"
{more}
"#
            ),
        )
        .unwrap();
        Self {
            config,
            public: format!("http://127.0.0.1:{public}"),
            admin: format!("http://127.0.0.1:{admin}"),
            child: None,
            open_files: None,
        }
    }

    pub(crate) fn command(&self, args: &[&str]) -> Command {
        let binary = env!("CARGO_BIN_EXE_justonce");
        let mut command = match self.open_files {
            Some(limit) => {
                let mut command = Command::new("prlimit");
                command.arg(format!("--nofile={limit}:{limit}")).arg(binary);
                command
            }
            None => Command::new(binary),
        };
        without_inherited_settings(&mut command);
        command
            .arg("--config")
            .arg(&self.config)
            .args(args)
            .env("DEMO_SECRET", SECRET)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        command
    }

    /// Starts `serve` and waits until it answers.
    pub(crate) async fn start(&mut self) {
        self.start_with(&[]).await;
    }

    /// Starts `serve` with `args` added and waits until it answers.
    pub(crate) async fn start_with(&mut self, args: &[&str]) {
        let command = self.command(&[&["serve"], args].concat()).spawn();
        self.child = Some(command.expect("start justonce"));
        self.await_up().await;
    }

    /// Starts `serve` with `args` and `env` added and its stderr captured, and waits until
    /// it answers; the handle gives every line it wrote once it has stopped. It logs what
    /// it does by default unless `env` sets `RUST_LOG`.
    pub(crate) async fn start_logged(
        &mut self,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> tokio::task::JoinHandle<Vec<String>> {
        use tokio::io::AsyncBufReadExt;
        let mut command = self.command(&[&["serve"], args].concat());
        command
            .env_remove("RUST_LOG")
            .envs(env.iter().copied())
            .stderr(Stdio::piped());
        let mut child = command.spawn().expect("start justonce");
        let mut stderr = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let lines = tokio::spawn(async move {
            let mut lines = Vec::new();
            while let Some(line) = stderr.next_line().await.unwrap() {
                lines.push(line);
            }
            lines
        });
        self.child = Some(child);
        self.await_up().await;
        lines
    }

    async fn await_up(&self) {
        let client = client();
        for _ in 0..600 {
            // The admin listener: a server without the receiver role has no public one.
            let health = client.get(format!("{}/healthz", self.admin)).send().await;
            if health.is_ok_and(|r| r.status().is_success()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("justonce serve did not come up");
    }

    pub(crate) async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().await.unwrap();
        }
    }

    pub(crate) async fn stop(&mut self) {
        if let Some(child) = self.child.take() {
            let pid = child.id().unwrap().to_string();
            let status = std::process::Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap();
            assert!(status.success());
            let output = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
                .await
                .expect("serve did not stop on SIGTERM")
                .unwrap();
            assert!(
                output.status.success(),
                "serve exited with {:?}",
                output.status
            );
        }
    }

    pub(crate) async fn run(&self, args: &[&str]) -> (i32, String) {
        let output = self.command(args).output().await.unwrap();
        (
            output.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&output.stdout).into_owned(),
        )
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.config);
    }
}

/// Runs `serve` with `env` added, which must stop at start with exit 2: what it wrote to
/// stderr.
pub(crate) async fn serve_exits_2_at_start(server: &Server, env: &[(&str, &str)]) -> String {
    let output = server
        .command(&["serve"])
        .envs(env.iter().copied())
        .stderr(Stdio::piped())
        .output();
    let output = tokio::time::timeout(Duration::from_secs(60), output)
        .await
        .expect("serve stops at start")
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    stderr
}

/// Leaves out the variables that would configure `justonce` from the test's own
/// environment, such as the suite's `JUSTONCE_TEST_*`, a `DATABASE_URL` and the
/// OpenTelemetry ones: a child sees only the settings its test gives it.
pub(crate) fn without_inherited_settings(command: &mut Command) {
    for (name, _) in std::env::vars_os() {
        let name_text = name.to_string_lossy();
        if name_text.starts_with("JUSTONCE_")
            || name_text.starts_with("OTEL_")
            || name == "DATABASE_URL"
        {
            command.env_remove(name);
        }
    }
}

/// A plain HTTP client; the TLS provider is installed only because reqwest asks for one.
pub(crate) fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

pub(crate) fn signature(body: &str) -> String {
    signature_of(body.as_bytes())
}

fn signature_of(body: &[u8]) -> String {
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(SECRET.as_bytes()).unwrap();
    mac.update(body);
    let hex: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256={hex}")
}

/// Posts one event; returns the status and the answer's `status` field.
pub(crate) async fn post(
    client: &reqwest::Client,
    server: &str,
    body: &str,
) -> Result<(u16, String), reqwest::Error> {
    let response = client
        .post(format!("{server}/webhooks/demo"))
        .header("content-type", "application/json")
        .header("x-signature", signature(body))
        .body(body.to_owned())
        .timeout(Duration::from_secs(10))
        .send()
        .await?;
    let status = response.status().as_u16();
    let text = response.text().await?;
    let answer = text
        .split("\"status\":\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_default()
        .to_owned();
    Ok((status, answer))
}

/// Runs `command`, which must exit 2 (bad usage or configuration), and returns its stderr.
pub(crate) async fn usage_error(command: &mut Command) -> String {
    let output = command.stderr(Stdio::piped()).output().await.unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    stderr
}

pub(crate) async fn text_of(client: &reqwest::Client, url: &str) -> String {
    client.get(url).send().await.unwrap().text().await.unwrap()
}

/// The database URL a server of this test uses, and the database to clean up after.
pub(crate) async fn database<DB: TestBackend>(test: &str) -> (TestDb<DB>, String) {
    let db = TestDb::<DB>::new(test).await;
    // The server uses the default table prefix: on a server, give it a database of its own.
    let url = if DB::NAME == "SQLite" {
        db.url.clone()
    } else {
        DB::create_database(db.prefix.trim_end_matches('_')).await
    };
    (db, url)
}

pub(crate) async fn drop_database<DB: TestBackend>(db: TestDb<DB>, url: &str) {
    if DB::NAME != "SQLite" {
        DB::drop_database(url).await;
    }
    db.cleanup().await;
}

/// A connection to the shared Redis, with `order-1`, `order-2` and `order-1` again added to
/// `stream`, each with its `order_id` field and a JSON body.
pub(crate) async fn redis_orders(stream: &str) -> redis::aio::MultiplexedConnection {
    use redis::AsyncCommands;
    let mut redis = redis::Client::open(justonce_tests::redis_url().as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("Redis");
    for id in ["order-1", "order-2", "order-1"] {
        let body = format!(r#"{{"order":"{id}"}}"#);
        let fields = [("order_id", id), ("body", body.as_str())];
        let _: String = redis.xadd(stream, "*", &fields).await.unwrap();
    }
    redis
}

/// The bodies the sink received, by Idempotency-Key.
pub(crate) fn received_by_key(sink: &Sink) -> HashMap<String, Vec<Vec<u8>>> {
    let mut by_key: HashMap<String, Vec<Vec<u8>>> = HashMap::new();
    for request in sink.received() {
        by_key
            .entry(request.key.unwrap_or_default())
            .or_default()
            .push(request.body);
    }
    by_key
}

/// Waits until the sink has seen `keys` distinct keys.
pub(crate) async fn await_keys(sink: &Sink, keys: usize) -> HashMap<String, Vec<Vec<u8>>> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let by_key = received_by_key(sink);
        if by_key.len() >= keys || tokio::time::Instant::now() > deadline {
            return by_key;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn every_event_posted_twice_is_delivered_once_per_key<DB: TestBackend>(test: &str) {
    let (db, url) = database::<DB>(test).await;
    let sink = Sink::start().await;
    let mut server = Server::configure(&url, &sink.url());
    server.start().await;
    let client = client();
    for n in 0..200 {
        let body = format!(r#"{{"id":"evt_{n}","n":{n}}}"#);
        assert_eq!(
            post(&client, &server.public, &body).await.unwrap(),
            (200, "accepted".into())
        );
        assert_eq!(
            post(&client, &server.public, &body).await.unwrap(),
            (200, "duplicate".into())
        );
    }
    // 100 events, each posted by 8 clients at once.
    let mut racing = Vec::new();
    for n in 200..300 {
        for _ in 0..8 {
            let (client, public) = (client.clone(), server.public.clone());
            racing.push(tokio::spawn(async move {
                post(&client, &public, &format!(r#"{{"id":"evt_{n}","n":{n}}}"#))
                    .await
                    .unwrap()
            }));
        }
    }
    let mut accepted = 0;
    for answer in racing {
        let (status, answer) = answer.await.unwrap();
        assert_eq!(status, 200);
        accepted += usize::from(answer == "accepted");
    }
    assert_eq!(accepted, 100);

    let by_key = await_keys(&sink, 300).await;
    assert_eq!(by_key.len(), 300);
    for n in 0..300 {
        let bodies = &by_key[&format!("demo:evt_{n}")];
        assert_eq!(
            bodies[0],
            format!(r#"{{"id":"evt_{n}","n":{n}}}"#).into_bytes()
        );
        assert!(bodies.iter().all(|b| *b == bodies[0]));
    }
    // The receiver has every delivery; the relay records the last ones a moment later.
    let all_sent = serde_json::json!({"sent": 300, "due": 0, "dead": 0});
    let mut stats = serde_json::Value::Null;
    for _ in 0..300 {
        stats = stats_json(&server).await;
        if stats["deliveries"] == all_sent {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(stats["deliveries"], all_sent);
    assert_eq!(
        stats["keys"],
        serde_json::json!([{"consumer": "demo", "scope": null, "keys": 300, "in_progress": 0}])
    );
    let (code, shown) = server
        .run(&["keys", "show", "demo:evt_0", "--consumer", "demo"])
        .await;
    assert_eq!(code, 0, "{shown}");
    assert!(shown.contains("state:       done"), "{shown}");
    assert!(shown.contains("key:         demo:evt_0"), "{shown}");
    let (code, _) = server
        .run(&["keys", "show", "demo:never", "--consumer", "demo"])
        .await;
    assert_eq!(code, 1, "an unknown key is a failure");
    let expected = [
        r#"justonce_webhooks_total{source="demo",outcome="accepted"} 300"#,
        r#"justonce_webhooks_total{source="demo",outcome="duplicate"} 900"#,
        r#"justonce_deliveries_total{outcome="sent",destination="demo"} 300"#,
        "justonce_deliveries_due 0",
        "justonce_store_up 1",
        // Every key is seconds old: nothing is past its retention.
        r#"justonce_purge_lag_seconds{consumer="demo"} 0"#,
    ];
    // The gauges read from the database are refreshed every 5 s.
    let mut metrics = String::new();
    for _ in 0..100 {
        metrics = text_of(&client, &format!("{}/metrics", server.admin)).await;
        if expected
            .iter()
            .all(|line| metrics.lines().any(|l| l == *line))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for line in expected {
        assert!(
            metrics.lines().any(|l| l == line),
            "{line:?} not in\n{metrics}"
        );
    }
    // The console's dashboard reads the database; the duplicates reach it within a second
    // or so.
    let figures = [
        "data-figure=\"accepted\">300<",
        "data-figure=\"duplicates\">900<",
        "data-figure=\"sent\">300<",
        "data-figure=\"backlog\">0<",
    ];
    let mut dashboard = String::new();
    for _ in 0..100 {
        dashboard = text_of(&client, &format!("{}/?since=1h", server.admin)).await;
        if figures.iter().all(|figure| dashboard.contains(figure)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for figure in figures {
        assert!(dashboard.contains(figure), "{figure} not in\n{dashboard}");
    }
    let public_metrics = client
        .get(format!("{}/metrics", server.public))
        .send()
        .await
        .unwrap();
    assert_eq!(
        public_metrics.status(),
        404,
        "metrics are for the admin listener only"
    );
    server.stop().await;
    drop_database(db, &url).await;
}

async fn a_server_killed_twenty_times_loses_no_acknowledged_event<DB: TestBackend>(test: &str) {
    let (db, url) = database::<DB>(test).await;
    let sink = Sink::start().await;
    let mut server = Server::configure(&url, &sink.url());
    let events = 5_000;
    let client = client();
    let mut next = 0;
    for round in 0..20 {
        server.start().await;
        // A sender that retries each event until it gets a 2xx, while the server is killed.
        let until = tokio::time::Instant::now() + Duration::from_millis(50 + 20 * round);
        while next < events && tokio::time::Instant::now() < until {
            let body = format!(r#"{{"id":"evt_{next}","n":{next}}}"#);
            if matches!(post(&client, &server.public, &body).await, Ok((200, _))) {
                next += 1;
            }
        }
        server.kill().await;
    }
    server.start().await;
    while next < events {
        let body = format!(r#"{{"id":"evt_{next}","n":{next}}}"#);
        if matches!(post(&client, &server.public, &body).await, Ok((200, _))) {
            next += 1;
        }
    }
    let by_key = await_keys(&sink, events).await;
    assert_eq!(
        by_key.len(),
        events,
        "every acknowledged event reaches the receiver"
    );
    assert!(
        by_key
            .values()
            .all(|bodies| bodies.iter().all(|b| *b == bodies[0])),
        "a key reached the receiver with two bodies"
    );
    server.stop().await;
    drop_database(db, &url).await;
}

/// The console: the dashboard counts the events and the duplicate, the failed attempt; the
/// dead-letters page lists the refused event with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_shows_the_last_hour_and_the_dead_letters_with_their_reasons() {
    let (db, url) = database::<justonce_sql::sqlx::Sqlite>("console").await;
    let refusing: justonce_tests::Script = std::sync::Arc::new(|key: &str, _| {
        if key.contains("evt_bad") {
            justonce_tests::Answer::status(422)
        } else {
            justonce_tests::Answer::status(200)
        }
    });
    let sink = Sink::scripted(refusing).await;
    let mut server = Server::configure(&url, &sink.url());
    server.start().await;
    let client = client();
    for body in [
        r#"{"id":"evt_1"}"#,
        r#"{"id":"evt_1"}"#,
        r#"{"id":"evt_bad"}"#,
    ] {
        assert_eq!(post(&client, &server.public, body).await.unwrap().0, 200);
    }
    let figures = [
        "data-figure=\"accepted\">2<",
        "data-figure=\"duplicates\">1<",
        "data-figure=\"sent\">1<",
        "data-figure=\"failed\">1<",
    ];
    let mut page = String::new();
    for _ in 0..200 {
        page = text_of(&client, &format!("{}/", server.admin)).await;
        if figures.iter().all(|figure| page.contains(figure)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for figure in figures {
        assert!(page.contains(figure), "{figure} not in\n{page}");
    }
    assert!(page.contains("<svg"), "{page}");
    let page = text_of(&client, &format!("{}/dead-letters", server.admin)).await;
    let dead_letter = page
        .split("<tr ")
        .find(|row| row.contains("demo:evt_bad"))
        .unwrap_or_else(|| panic!("the dead letter is listed: {page}"));
    assert!(dead_letter.contains("422"), "its reason: {dead_letter}");
    server.stop().await;
    drop_database(db, &url).await;
}

#[tokio::test]
async fn bad_configuration_exits_2_and_names_the_problem() {
    let server = Server::configure("mongodb://nowhere", "http://127.0.0.1:1/x");
    let output = server
        .command(&["check"])
        .stderr(Stdio::piped())
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("server.database"));
    let output = server
        .command(&["dlq", "replay"])
        .stderr(Stdio::piped())
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "usage errors exit 2");
}

/// `check` resolves each target's host: one that does not resolve fails it, named with its
/// source, and nothing else does.
#[tokio::test]
async fn check_names_a_target_whose_host_does_not_resolve() {
    let (db, url) = database::<justonce_sql::sqlx::Sqlite>("check-targets").await;
    let server = Server::configure(&url, "http://localhost:1/x");
    assert_eq!(server.run(&["migrate"]).await.0, 0);
    let (code, checked) = server.run(&["check"]).await;
    assert_eq!(code, 0, "{checked}");
    let server = Server::configure(&url, "http://target.invalid/hooks");
    let output = server
        .command(&["check"])
        .stderr(Stdio::piped())
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("source demo: ")
            && stderr.contains("the host of http://target.invalid/hooks does not resolve"),
        "{stderr}"
    );
    drop_database(db, &url).await;
}

/// A fault test that names a failpoint `serve` does not have would wait for a pause that
/// never comes: `serve` refuses to start and names the one it has.
#[tokio::test]
async fn an_unknown_failpoint_stops_serve_at_start() {
    let (db, url) = database::<justonce_sql::sqlx::Sqlite>("unknown-failpoint").await;
    let server = Server::configure(&url, "http://127.0.0.1:1/x");
    let output = server
        .command(&["serve"])
        .env("JUSTONCE_FAILPOINT", "stored-not-answerd")
        .stderr(Stdio::piped())
        .output();
    let output = tokio::time::timeout(Duration::from_secs(30), output)
        .await
        .expect("serve refuses to start")
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("serve has no such failpoint; it has stored-not-answered"),
        "{stderr}"
    );
    drop_database(db, &url).await;
}

/// Two `serve` processes on one PostgreSQL database: an event posted to one and again to
/// the other is stored once, and every event is delivered. Both consoles' dashboards show
/// the store's counts, the duplicates of both processes added up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_on_one_postgres_database_share_the_work_and_one_dashboard() {
    const EVENTS: usize = 1_000;
    let (db, url) = database::<justonce_sql::sqlx::Postgres>("two-servers").await;
    let sink = Sink::start().await;
    let mut servers = [
        Server::configure(&url, &sink.url()),
        Server::configure(&url, &sink.url()),
    ];
    for server in &mut servers {
        server.start().await;
    }
    let client = client();
    for n in 0..EVENTS {
        let body = format!(r#"{{"id":"evt_{n}","n":{n}}}"#);
        let (first, second) = (&servers[n % 2], &servers[(n + 1) % 2]);
        assert_eq!(
            post(&client, &first.public, &body).await.unwrap(),
            (200, "accepted".into())
        );
        assert_eq!(
            post(&client, &second.public, &body).await.unwrap(),
            (200, "duplicate".into())
        );
    }
    let by_key = await_keys(&sink, EVENTS).await;
    assert_eq!(by_key.len(), EVENTS);
    assert!(
        by_key
            .values()
            .all(|bodies| bodies.iter().all(|b| *b == bodies[0]))
    );
    let store = justonce_sql::Inbox::<justonce_sql::sqlx::Postgres>::connect(
        &url,
        justonce_sql::Consumer::new("reader").unwrap(),
    )
    .await
    .unwrap();
    let stats = store.outbox().stats().await.unwrap();
    assert_eq!((stats.sent, stats.due, stats.dead), (EVENTS as i64, 0, 0));
    let expected = serde_json::json!({
        "accepted": EVENTS, "duplicates": EVENTS, "sent": EVENTS, "failed": 0
    });
    for server in &servers {
        let mut totals = serde_json::Value::Null;
        // Each process adds its duplicates to the store about every second.
        for _ in 0..100 {
            let answer = text_of(&client, &format!("{}/api/v1/dashboard", server.admin)).await;
            let dashboard: serde_json::Value = serde_json::from_str(&answer).unwrap();
            totals = dashboard["totals"].clone();
            if totals == expected {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(totals, expected, "{}", server.admin);
    }
    store.pool().close().await;
    for server in &mut servers {
        server.stop().await;
    }
    drop_database(db, &url).await;
}

/// The SQLite server still answers its health check, and stored no key.
async fn assert_up_with_nothing_stored(server: &Server, db: &TestDb<justonce_sql::sqlx::Sqlite>) {
    let health = client()
        .get(format!("{}/healthz", server.public))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    // The server's own tables, beside the test's in the same file.
    let stored = <justonce_sql::sqlx::Sqlite as TestBackend>::count(
        db.inbox.pool(),
        "SELECT count(*) FROM justonce_keys".to_owned(),
    )
    .await;
    assert_eq!(stored, 0);
}

/// A Content-Length smaller than the body: the server reads only what was declared, which
/// does not verify, answers 401, and stays up.
#[tokio::test]
async fn a_short_content_length_is_refused_and_the_server_stays_up() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (db, url) = database::<justonce_sql::sqlx::Sqlite>("short-length").await;
    let mut server = Server::configure(&url, "http://127.0.0.1:1/unused");
    server.start().await;
    let body = r#"{"id":"evt_1"}"#;
    let request = format!(
        "POST /webhooks/demo HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         X-Signature: {}\r\nContent-Length: 5\r\n\r\n{body}",
        signature(body)
    );
    let address = server.public.trim_start_matches("http://").to_owned();
    let mut stream = tokio::net::TcpStream::connect(&address).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = vec![0; 4096];
    let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut answer))
        .await
        .unwrap()
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..read]);
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert_up_with_nothing_stored(&server, &db).await;
    server.stop().await;
    drop_database(db, &url).await;
}

/// What follows a request's head on the wire: nothing, or `n` bytes of `x` as they are or
/// as HTTP/1.1 chunks.
#[derive(Clone, Copy)]
enum Trailing {
    Nothing,
    Plain(usize),
    Chunked(usize),
}

/// Sends `head` and then the trailing body in 64 KiB writes while reading the answer, and
/// returns the status line. The server may close the connection before the body is sent;
/// the answer is read all the same.
async fn post_raw(address: &str, head: Vec<u8>, trailing: Trailing) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let (mut reader, mut writer) = stream.into_split();
    let sender = tokio::spawn(async move {
        writer.write_all(&head).await?;
        const CHUNK: usize = 64 << 10;
        let plain = vec![b'x'; CHUNK];
        let chunked = [format!("{CHUNK:x}\r\n").as_bytes(), &plain, b"\r\n"].concat();
        match trailing {
            Trailing::Nothing => {}
            Trailing::Plain(bytes) => {
                for _ in 0..bytes / CHUNK {
                    writer.write_all(&plain).await?;
                }
            }
            Trailing::Chunked(bytes) => {
                for _ in 0..bytes / CHUNK {
                    writer.write_all(&chunked).await?;
                }
                writer.write_all(b"0\r\n\r\n").await?;
            }
        }
        // Dropping the writer would half-close the connection, which the server takes
        // for a client that left; keep it open until the answer is read.
        std::future::pending::<std::io::Result<()>>().await
    });
    let mut answer = Vec::new();
    let mut buffer = [0; 1024];
    while !answer.windows(2).any(|w| w == b"\r\n") {
        let read = tokio::time::timeout(Duration::from_secs(30), reader.read(&mut buffer))
            .await
            .expect("an answer within 30 s")
            .unwrap();
        assert!(
            read > 0,
            "the server closed the connection without answering"
        );
        answer.extend_from_slice(&buffer[..read]);
    }
    sender.abort();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    answer.lines().next().unwrap_or_default().to_owned()
}

/// Hostile bodies, 32 at a time, against a 64 KiB limit: 100 times the limit with and
/// without a Content-Length, invalid UTF-8 and JSON nested 30,000 deep. Each gets its 4xx,
/// the server stays up, and its peak memory grows by far less than the bytes sent at once
/// (a server that buffered whole bodies would grow by 200 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_bodies_get_4xx_and_leave_memory_bounded() {
    const LIMIT: usize = 64 << 10;
    const AT_ONCE: usize = 32;
    let (db, url) = database::<justonce_sql::sqlx::Sqlite>("hostile-bodies").await;
    let mut server = Server::configure(&url, "http://127.0.0.1:1/unused");
    server.start().await;
    let pid = server.child.as_ref().and_then(|c| c.id()).unwrap();
    let address = server.public.trim_start_matches("http://").to_owned();
    let head = |extra: &str| {
        format!(
            "POST /webhooks/demo HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
             X-Signature: {}\r\n{extra}\r\n",
            signature("")
        )
        .into_bytes()
    };
    let before = peak_rss_mib(Some(pid));
    let oversized = 100 * LIMIT;
    let deep = format!("{{\"id\":{}{}}}", "[".repeat(30_000), "]".repeat(30_000));
    // A lone continuation byte: not UTF-8, so not JSON.
    let invalid_utf8 = b"{\"id\":\"\x80\"}";
    let cases: Vec<(Vec<u8>, Trailing, &str)> = vec![
        (
            head(&format!("Content-Length: {oversized}\r\n")),
            Trailing::Plain(oversized),
            "HTTP/1.1 413",
        ),
        (
            head("Transfer-Encoding: chunked\r\n"),
            Trailing::Chunked(oversized),
            "HTTP/1.1 413",
        ),
        (
            format!(
                "POST /webhooks/demo HTTP/1.1\r\nHost: test\r\nX-Signature: {}\r\n\
                 Content-Length: {}\r\n\r\n{deep}",
                signature(&deep),
                deep.len()
            )
            .into_bytes(),
            Trailing::Nothing,
            "HTTP/1.1 400",
        ),
        (
            [
                format!(
                    "POST /webhooks/demo HTTP/1.1\r\nHost: test\r\nX-Signature: {}\r\n\
                     Content-Length: {}\r\n\r\n",
                    signature_of(invalid_utf8),
                    invalid_utf8.len()
                )
                .as_bytes(),
                invalid_utf8,
            ]
            .concat(),
            Trailing::Nothing,
            "HTTP/1.1 400",
        ),
    ];
    for (case, (head, trailing, expected)) in cases.into_iter().enumerate() {
        let tasks: Vec<_> = (0..AT_ONCE)
            .map(|_| {
                let (address, head) = (address.clone(), head.clone());
                tokio::spawn(async move { post_raw(&address, head, trailing).await })
            })
            .collect();
        for task in tasks {
            let status = task.await.unwrap();
            assert!(status.starts_with(expected), "case {case}: {status}");
        }
    }
    let grown = peak_rss_mib(Some(pid)) - before;
    let sent_at_once = (AT_ONCE * oversized) as f64 / (1 << 20) as f64;
    eprintln!(
        "hostile bodies: peak RSS grew by {grown:.1} MiB while {sent_at_once:.0} MiB were sent at once"
    );
    // Room for each connection's buffers and one body at the limit, not for the bodies.
    assert!(
        grown < sent_at_once / 10.0,
        "peak RSS grew by {grown:.1} MiB"
    );
    assert_up_with_nothing_stored(&server, &db).await;
    server.stop().await;
    drop_database(db, &url).await;
}

pub(crate) fn amqp_url() -> String {
    std::env::var("JUSTONCE_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// `serve` consuming a RabbitMQ queue: 120 messages for 100 ids reach the target once per
/// id, each with `Idempotency-Key: orders:<id>`.
async fn a_queue_consumed_by_the_service_reaches_its_target_once_per_key<DB: TestBackend>(
    test: &str,
) {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    let (db, url) = database::<DB>(test).await;
    let sink = Sink::start().await;
    let queue = format!("{}orders", db.prefix);
    let consumer = format!(
        "[consumers.orders]\nfrom = \"{}\"\nqueue = \"{queue}\"\ntarget = \"{}\"\n",
        amqp_url(),
        sink.url()
    );
    let mut server = Server::configure_with(&url, &sink.url(), &consumer);
    server.start().await;

    let connection =
        lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
            .await
            .expect("RabbitMQ");
    let channel = connection.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    // The service declares the queue once it is consuming.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let probe = connection.create_channel().await.unwrap();
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        if probe
            .queue_declare(queue.as_str().into(), passive, Default::default())
            .await
            .is_ok()
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the service never declared {queue}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for n in 0..120 {
        let id = format!("order-{}", n % 100);
        let mut headers = lapin::types::FieldTable::default();
        for (name, value) in SENDERS_TRACE {
            headers.insert(
                name.into(),
                lapin::types::AMQPValue::LongString(value.into()),
            );
        }
        let properties = lapin::BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_content_type("application/json".into())
            .with_headers(headers)
            .with_delivery_mode(2);
        let body = format!(r#"{{"order":"{id}"}}"#);
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                properties,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack());
    }
    assert_each_order_delivered_once(&sink).await;
    server.stop().await;
    delete_queue(&channel, &queue).await;
    drop_database(db, &url).await;
}

/// Deletes the RabbitMQ queue `queue` and its dead-letter queue.
pub(crate) async fn delete_queue(channel: &lapin::Channel, queue: &str) {
    for name in [format!("{queue}.dead"), queue.to_owned()] {
        channel
            .queue_delete(
                name.as_str().into(),
                lapin::options::QueueDeleteOptions::default(),
            )
            .await
            .unwrap();
    }
}

/// The trace context every order is published with.
const SENDERS_TRACE: [(&str, &str); 2] = [
    (
        "traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    ),
    ("tracestate", "rojo=00f067aa0ba902b7"),
];

/// 100 orders reached the sink, each with `Idempotency-Key: orders:order-<n>`, its own body,
/// content type and trace context, however often it was published.
async fn assert_each_order_delivered_once(sink: &Sink) {
    let by_key = await_keys(sink, 100).await;
    assert_eq!(by_key.len(), 100, "every id reached the target");
    for n in 0..100 {
        let bodies = &by_key[&format!("orders:order-{n}")];
        let expected = format!(r#"{{"order":"order-{n}"}}"#);
        assert!(bodies.iter().all(|body| *body == expected.as_bytes()));
    }
    let received = sink.received();
    assert!(
        received
            .iter()
            .all(|r| r.headers["content-type"] == "application/json")
    );
    for request in &received {
        for (name, value) in SENDERS_TRACE {
            assert_eq!(request.headers.get(name).map(String::as_str), Some(value));
        }
    }
}

/// `serve` consuming a NATS JetStream stream: 120 messages for 100 ids reach the target
/// once per id.
async fn a_stream_consumed_by_the_service_reaches_its_target_once_per_key<DB: TestBackend>(
    test: &str,
) {
    let (db, url) = database::<DB>(test).await;
    let sink = Sink::start().await;
    let nats = std::env::var("JUSTONCE_TEST_NATS_URL")
        .unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let stream = format!("{}ORDERS", db.prefix);
    let consumer = format!(
        "[consumers.orders]\nfrom = \"{nats}\"\nstream = \"{stream}\"\n\
         id = \"header:Order-Id\"\ntarget = \"{}\"\n",
        sink.url()
    );
    let mut server = Server::configure_with(&url, &sink.url(), &consumer);
    server.start().await;
    let client = async_nats::connect(&nats).await.expect("NATS");
    let jetstream = async_nats::jetstream::new(client);
    // The service creates the stream once it is consuming.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while jetstream.get_stream(&stream).await.is_err() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the service never created {stream}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for n in 0..120 {
        let id = format!("order-{}", n % 100);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Order-Id", id.as_str());
        headers.insert("Content-Type", "application/json");
        for (name, value) in SENDERS_TRACE {
            headers.insert(name, value);
        }
        let body = format!(r#"{{"order":"{id}"}}"#);
        jetstream
            .publish_with_headers(stream.clone(), headers, body.into_bytes().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    assert_each_order_delivered_once(&sink).await;
    server.stop().await;
    for name in [format!("{stream}_DEAD"), stream] {
        jetstream.delete_stream(&name).await.unwrap();
    }
    drop_database(db, &url).await;
}

/// `serve` consuming a Redis stream in a consumer group: 120 entries for 100 ids reach the
/// target once per id.
async fn a_redis_stream_consumed_by_the_service_reaches_its_target_once_per_key<DB: TestBackend>(
    test: &str,
) {
    use redis::AsyncCommands;
    let (db, url) = database::<DB>(test).await;
    let sink = Sink::start().await;
    let redis_url = justonce_tests::redis_url();
    let stream = format!("{}orders", db.prefix);
    let mut redis = redis::Client::open(redis_url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("Redis");
    // Added before the service starts: its group begins at the start of the stream.
    for n in 0..120 {
        let id = format!("order-{}", n % 100);
        let body = format!(r#"{{"order":"{id}"}}"#);
        let _: String = redis
            .xadd(
                &stream,
                "*",
                &[
                    ("order_id", id.as_str()),
                    ("body", body.as_str()),
                    ("content-type", "application/json"),
                    SENDERS_TRACE[0],
                    SENDERS_TRACE[1],
                ],
            )
            .await
            .unwrap();
    }
    let consumer = format!(
        "[consumers.orders]\nfrom = \"{redis_url}\"\nstream = \"{stream}\"\n\
         id = \"header:order_id\"\ntarget = \"{}\"\n",
        sink.url()
    );
    let mut server = Server::configure_with(&url, &sink.url(), &consumer);
    server.start().await;
    assert_each_order_delivered_once(&sink).await;
    server.stop().await;
    let _: () = redis.del(&stream).await.unwrap();
    drop_database(db, &url).await;
}

/// `serve` consuming a Kafka topic as a group member: 120 records for 100 ids (in the
/// CloudEvents `ce_id` header) reach the target once per id, and `stats` shows the
/// partition's stored offset at the topic's last record.
async fn a_kafka_topic_consumed_by_the_service_reaches_its_target_once_per_key<DB: TestBackend>(
    test: &str,
) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let (db, url) = database::<DB>(test).await;
    let sink = Sink::start().await;
    let kafka = justonce_tests::kafka_url();
    let topic = format!("{}orders", db.prefix);
    let mut client = rdkafka::ClientConfig::new();
    client.set("bootstrap.servers", kafka.trim_start_matches("kafka://"));
    let admin: AdminClient<DefaultClientContext> = client.create().unwrap();
    let new = NewTopic::new(&topic, 1, TopicReplication::Fixed(1));
    for created in admin
        .create_topics([&new], &AdminOptions::new())
        .await
        .expect("Kafka")
    {
        created.unwrap();
    }
    let producer: FutureProducer = client.create().unwrap();
    // Produced before the service starts: a partition with no stored offset starts at its
    // first record.
    for n in 0..120 {
        let id = format!("order-{}", n % 100);
        let mut headers = OwnedHeaders::new()
            .insert(Header {
                key: "ce_id",
                value: Some(id.as_str()),
            })
            .insert(Header {
                key: "content-type",
                value: Some("application/json"),
            });
        for (name, value) in SENDERS_TRACE {
            headers = headers.insert(Header {
                key: name,
                value: Some(value),
            });
        }
        let body = format!(r#"{{"order":"{id}"}}"#);
        let record = FutureRecord::to(&topic)
            .key("customer:1")
            .payload(&body)
            .headers(headers);
        producer
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| e)
            .unwrap();
    }
    // A group of its own: runs on the three databases, and runs before, would otherwise
    // share the group "orders", and each join would wait for the others' rebalance.
    let consumer = format!(
        "[consumers.orders]\nfrom = \"{kafka}\"\ntopic = \"{topic}\"\ngroup = \"{topic}\"\n\
         id = \"header:ce_id\"\ntarget = \"{}\"\n",
        sink.url()
    );
    let mut server = Server::configure_with(&url, &sink.url(), &consumer);
    server.start().await;
    assert_each_order_delivered_once(&sink).await;
    let ready = (self::client()
        .get(format!("{}/readyz", server.public))
        .send()
        .await)
        .unwrap();
    assert_eq!(
        ready.status(),
        200,
        "the consumer is connected once the broker answered"
    );
    // The last 20 records are duplicates: their offset is stored once the reader is idle.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let stats = stats_json(&server).await;
        let offsets = stats["offsets"].as_array().unwrap().clone();
        let stored = offsets
            .iter()
            .find(|offset| offset["stream"] == topic.as_str())
            .map(|offset| {
                (
                    offset["consumer"].clone(),
                    offset["partition"].clone(),
                    offset["position"].clone(),
                )
            });
        if stored == Some(("orders".into(), 0.into(), 119.into())) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "offsets: {offsets:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    server.stop().await;
    admin
        .delete_topics(&[&topic], &AdminOptions::new())
        .await
        .unwrap();
    drop_database(db, &url).await;
}

/// `serve` consuming an MQTT topic on a persistent session: 120 messages for 100 ids,
/// published while the service was not yet running, reach the target once per id.
async fn an_mqtt_topic_consumed_by_the_service_reaches_its_target_once_per_key<DB: TestBackend>(
    test: &str,
) {
    use justonce_sql::{Delivered, Delivery, Destination};
    use justonce_transport::mqtt::{MqttConsumer, MqttDestination, MqttOptions};
    let (db, url) = database::<DB>(test).await;
    let sink = Sink::start().await;
    let mqtt = justonce_tests::mqtt_url();
    let topic = format!("{}orders", db.prefix);
    let client_id = format!("{}service", db.prefix);
    // The session and its subscription exist before the messages, which wait in it for
    // the service.
    let session = MqttOptions::new(&topic, &client_id).session_expiry(Duration::from_secs(300));
    drop(
        MqttConsumer::connect(&mqtt, db.inbox.clone(), session)
            .await
            .expect("MQTT"),
    );
    let publisher = MqttDestination::new(&mqtt, &topic, &format!("{client_id}-p")).unwrap();
    let headers = [
        ("content-type", "application/json"),
        SENDERS_TRACE[0],
        SENDERS_TRACE[1],
    ]
    .map(|(name, value)| (name.to_owned(), value.to_owned()));
    for n in 0..120 {
        let id = format!("order-{}", n % 100);
        let body = format!(r#"{{"order":"{id}"}}"#);
        let delivery = Delivery {
            id: n,
            key: &id,
            destination: "orders",
            payload: body.as_bytes(),
            headers: &headers,
            attempt: 1,
        };
        assert_eq!(publisher.deliver(delivery).await, Delivered::Sent);
    }
    let consumer = format!(
        "[consumers.orders]\nfrom = \"{mqtt}\"\ntopic = \"{topic}\"\n\
         client_id = \"{client_id}\"\ntarget = \"{}\"\n",
        sink.url()
    );
    let mut server = Server::configure_with(&url, &sink.url(), &consumer);
    server.start().await;
    assert_each_order_delivered_once(&sink).await;
    server.stop().await;
    drop_database(db, &url).await;
}

/// `purge` deletes a source's keys past its retention, in batches, and says how far it got
/// on standard error, with the result alone on standard output.
async fn purge_deletes_only_keys_past_retention_and_reports_its_progress<DB: TestBackend>(
    test: &str,
) {
    let (db, url) = database::<DB>(test).await;
    let server = Server::configure(&url, "http://127.0.0.1:1/unused");
    assert_eq!(server.run(&["migrate"]).await.0, 0);
    let demo =
        justonce_sql::Inbox::<DB>::connect(&url, justonce_sql::Consumer::new("demo").unwrap())
            .await
            .unwrap();
    process_demo_events(&demo, 7).await;
    // Five of them eight days old: past the default retention of seven.
    for n in 0..5 {
        DB::age_key(
            demo.pool(),
            "justonce_",
            &format!("demo:evt_{n}"),
            8 * 86_400_000,
        )
        .await;
    }
    let output = server
        .command(&["purge", "--batch-size", "2", "--pause", "1"])
        .stderr(Stdio::piped())
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "purged 5 keys and 0 sent deliveries\n"
    );
    let progress = String::from_utf8_lossy(&output.stderr);
    assert!(
        progress
            .lines()
            .any(|line| line == "keys of demo: 5 purged"),
        "{progress}"
    );
    let left = DB::count(demo.pool(), "SELECT count(*) FROM justonce_keys".to_owned()).await;
    assert_eq!(left, 2);
    demo.pool().close().await;
    drop_database(db, &url).await;
}

/// Processes events `demo:evt_0` up to `demo:evt_<count - 1>` through `demo`, each for the
/// first time.
async fn process_demo_events<DB: TestBackend>(demo: &justonce_sql::Inbox<DB>, count: usize) {
    for n in 0..count {
        let key = justonce_sql::Key::new(format!("demo:evt_{n}")).unwrap();
        let outcome = demo
            .run(&key, b"{}", |_tx| {
                Box::pin(async { Ok::<_, justonce_sql::sqlx::Error>(()) })
            })
            .await
            .unwrap();
        assert_eq!(outcome, justonce_sql::Outcome::Processed(()));
    }
}

/// `justonce serve` purges on its own, at start and every `server.purge_every`: keys past
/// their retention go, and the others stay.
async fn serve_purges_keys_past_retention_on_its_schedule<DB: TestBackend>(test: &str) {
    let (db, url) = database::<DB>(test).await;
    let mut server = Server::configure_all(
        &url,
        "http://127.0.0.1:1/unused",
        r#"purge_every = "1s""#,
        "",
    );
    assert_eq!(server.run(&["migrate"]).await.0, 0);
    let demo =
        justonce_sql::Inbox::<DB>::connect(&url, justonce_sql::Consumer::new("demo").unwrap())
            .await
            .unwrap();
    let keys = |filter: &str| {
        DB::count(
            demo.pool(),
            format!("SELECT count(*) FROM justonce_keys{filter}"),
        )
    };
    server.start().await;
    process_demo_events(&demo, 4).await;
    // Three of them eight days old, while the server runs: past the retention of seven.
    for n in 0..3 {
        let key = format!("demo:evt_{n}");
        DB::age_key(demo.pool(), "justonce_", &key, 8 * 86_400_000).await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let left = keys("").await;
        assert!(left >= 1, "the purge deleted a key inside its retention");
        if left == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the server did not purge within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let fresh = format!(" WHERE {} = 'demo:evt_3'", DB::quoted("key"));
    assert_eq!(keys(&fresh).await, 1, "the key inside its retention stays");
    server.stop().await;
    demo.pool().close().await;
    drop_database(db, &url).await;
}

/// `migrate --print-sql` applied by hand, as a database administrator would, makes the
/// schema `migrate` would: `migrate` then has nothing left to do, and `check` passes.
async fn the_printed_migrations_make_a_schema_the_service_accepts<DB: TestBackend>(test: &str) {
    let (db, url) = database::<DB>(test).await;
    let server = Server::configure(&url, "http://127.0.0.1:1/unused");
    let (code, script) = server.run(&["migrate", "--print-sql"]).await;
    assert_eq!(code, 0, "{script}");
    assert!(script.contains("justonce_keys"), "{script}");
    let by_hand =
        justonce_sql::Inbox::<DB>::connect(&url, justonce_sql::Consumer::new("dba").unwrap())
            .await
            .unwrap();
    DB::execute(by_hand.pool(), script).await.unwrap();
    assert_eq!(
        server.run(&["migrate"]).await,
        (0, "0 migrations applied\n".to_owned())
    );
    let (code, checked) = server.run(&["check"]).await;
    assert_eq!(code, 0, "{checked}");
    let (code, later) = server
        .run(&["migrate", "--print-sql", "--since", "2"])
        .await;
    assert_eq!(code, 0);
    assert!(
        !later.contains("CREATE TABLE IF NOT EXISTS justonce_keys"),
        "{later}"
    );
    assert!(
        later.contains("CREATE TABLE IF NOT EXISTS justonce_breakers"),
        "{later}"
    );
    drop_database(db, &url).await;
}

/// Waits until the admin API lists `count` events, each delivered. The relay never takes a
/// delivered row again, so what a sink has received by then is all it will receive. Fails
/// after 60 s.
pub(crate) async fn all_delivered(server: &Server, count: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let page = text_of(&client(), &format!("{}/api/v1/events", server.admin)).await;
        let listed: serde_json::Value = serde_json::from_str(&page).unwrap();
        let events = listed["events"].as_array().unwrap();
        if events.len() == count && events.iter().all(|event| event["state"] == "delivered") {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not {count} events all delivered: {listed}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `stats --json` as parsed JSON, with the age of the oldest due delivery taken out (it
/// depends on the clock) after checking it is plausible.
pub(crate) async fn stats_json(server: &Server) -> serde_json::Value {
    let (code, printed) = server.run(&["stats", "--json"]).await;
    assert_eq!(code, 0, "{printed}");
    let mut stats: serde_json::Value = serde_json::from_str(&printed)
        .unwrap_or_else(|e| panic!("stats --json printed no JSON ({e}): {printed}"));
    let age = stats["deliveries"]
        .as_object_mut()
        .and_then(|deliveries| deliveries.remove("oldest_due_age_seconds"))
        .and_then(|age| age.as_f64())
        .unwrap_or_else(|| panic!("no oldest_due_age_seconds in {printed}"));
    assert!((0.0..600.0).contains(&age), "oldest due for {age} s");
    stats
}

/// A migrated database of a server's own, and a worker's inbox on it for consumer `worker`.
pub(crate) async fn server_and_worker<DB: TestBackend>(
    test: &str,
) -> (TestDb<DB>, String, Server, justonce_sql::Inbox<DB>) {
    let (db, url) = database::<DB>(test).await;
    let server = Server::configure(&url, "http://127.0.0.1:1/unused");
    assert_eq!(
        server.run(&["migrate"]).await,
        (0, "9 migrations applied\n".to_owned())
    );
    let worker =
        justonce_sql::Inbox::<DB>::connect(&url, justonce_sql::Consumer::new("worker").unwrap())
            .await
            .unwrap();
    (db, url, server, worker)
}

/// A lease for an hour on `key`, which must be free.
async fn acquire<DB: TestBackend>(
    inbox: &justonce_sql::Inbox<DB>,
    key: &str,
) -> justonce_sql::Lease {
    use justonce_sql::{Fingerprint, Key, LeaseClaim, Leases};
    let identity = inbox.identity(&Key::new(key).unwrap());
    let claim = inbox
        .claim_lease(&identity, &Fingerprint::of(key), Duration::from_secs(3600))
        .await
        .unwrap();
    match claim {
        LeaseClaim::Acquired(lease) => lease,
        other => panic!("{key} was not acquired: {other:?}"),
    }
}

/// What a claim of `key` (with the payload `acquire` uses) finds now.
async fn claim<DB: TestBackend>(
    inbox: &justonce_sql::Inbox<DB>,
    key: &str,
) -> justonce_sql::LeaseClaim {
    use justonce_sql::{Fingerprint, Key, Leases};
    let identity = inbox.identity(&Key::new(key).unwrap());
    inbox
        .claim_lease(&identity, &Fingerprint::of(key), Duration::from_secs(3600))
        .await
        .unwrap()
}

/// Runs `args` with stderr captured: the exit code, stdout and stderr.
pub(crate) async fn run_capturing(server: &Server, args: &[&str]) -> (i32, String, String) {
    let output = server
        .command(args)
        .stderr(Stdio::piped())
        .output()
        .await
        .unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A worker stuck on a lease for an hour: `keys release --yes` lets the next claim take
/// the key at once with a larger token, and the stuck worker's late complete is refused.
async fn keys_release_lets_the_next_claim_take_a_stuck_lease_at_once<DB: TestBackend>(test: &str) {
    use justonce_sql::{Error, Leases};
    let (db, url, server, worker) = server_and_worker::<DB>(test).await;
    let stuck = acquire(&worker, "charge:1").await;
    assert!(matches!(
        claim(&worker, "charge:1").await,
        justonce_sql::LeaseClaim::InProgress { .. }
    ));
    let (code, printed) = server
        .run(&[
            "keys",
            "release",
            "charge:1",
            "--consumer",
            "worker",
            "--yes",
        ])
        .await;
    assert_eq!(code, 0, "{printed}");
    assert!(printed.contains("key:         charge:1"), "{printed}");
    assert!(
        printed.contains("state:       in progress, lease ends in"),
        "what changes is shown first: {printed}"
    );
    assert!(
        printed.contains("released: the next claim takes charge:1 at once"),
        "{printed}"
    );
    let next = acquire(&worker, "charge:1").await;
    assert!(
        next.token > stuck.token,
        "{} after {}",
        next.token,
        stuck.token
    );
    let late = worker.complete(&stuck, b"late").await.unwrap_err();
    assert!(matches!(late, Error::LeaseLost { .. }), "{late}");
    worker.complete(&next, b"charged").await.unwrap();
    assert_eq!(
        claim(&worker, "charge:1").await,
        justonce_sql::LeaseClaim::Done {
            result: Some(b"charged".to_vec())
        }
    );
    worker.pool().close().await;
    drop_database(db, &url).await;
}

/// `keys complete --yes --result done` on a stuck lease: later claims find the key done
/// with that result, and the stuck worker can no longer complete, renew or release it.
async fn keys_complete_marks_a_stuck_lease_done_and_refuses_its_holder<DB: TestBackend>(
    test: &str,
) {
    use justonce_sql::{Error, LeaseClaim, Leases};
    let (db, url, server, worker) = server_and_worker::<DB>(test).await;
    let stuck = acquire(&worker, "charge:2").await;
    let (code, printed) = server
        .run(&[
            "keys",
            "complete",
            "charge:2",
            "--consumer",
            "worker",
            "--result",
            "done",
            "--yes",
        ])
        .await;
    assert_eq!(code, 0, "{printed}");
    assert!(
        printed.contains("state:       in progress, lease ends in"),
        "{printed}"
    );
    assert!(
        printed.contains("completed: charge:2 is done, with 4 bytes of result"),
        "{printed}"
    );
    assert_eq!(
        claim(&worker, "charge:2").await,
        LeaseClaim::Done {
            result: Some(b"done".to_vec())
        }
    );
    let refused = [
        worker.complete(&stuck, b"late").await,
        worker.renew(&stuck, Duration::from_secs(60)).await,
        worker.release(&stuck).await,
    ];
    for late in refused {
        assert!(matches!(late, Err(Error::LeaseLost { .. })), "{late:?}");
    }
    assert_eq!(
        claim(&worker, "charge:2").await,
        LeaseClaim::Done {
            result: Some(b"done".to_vec())
        },
        "the stuck worker changed nothing"
    );
    let (code, shown) = server
        .run(&["keys", "show", "charge:2", "--consumer", "worker"])
        .await;
    assert_eq!(code, 0, "{shown}");
    assert!(shown.contains("state:       done"), "{shown}");
    assert!(shown.contains("result:      4 bytes"), "{shown}");

    // Without --result, the key is done with no result, as a transactional claim leaves it.
    acquire(&worker, "charge:3").await;
    let (code, printed) = server
        .run(&[
            "keys",
            "complete",
            "charge:3",
            "--consumer",
            "worker",
            "--yes",
        ])
        .await;
    assert_eq!(code, 0, "{printed}");
    assert_eq!(
        claim(&worker, "charge:3").await,
        LeaseClaim::Done { result: None }
    );
    worker.pool().close().await;
    drop_database(db, &url).await;
}

/// Without --yes and with no terminal on stdin, both commands exit 2 and name --yes; a key
/// that is missing, done or in another scope fails with 1; a malformed key is bad usage.
/// None of them changes the key.
async fn keys_release_and_complete_change_nothing_unless_confirmed_on_a_lease_in_progress<
    DB: TestBackend,
>(
    test: &str,
) {
    use justonce_sql::{LeaseClaim, Leases};
    let (db, url, server, worker) = server_and_worker::<DB>(test).await;
    let held = acquire(&worker, "charge:held").await;
    let done = acquire(&worker, "charge:done").await;
    worker.complete(&done, b"receipt").await.unwrap();

    for action in ["release", "complete"] {
        let mut unconfirmed = vec!["keys", action, "charge:held", "--consumer", "worker"];
        if action == "complete" {
            unconfirmed.extend(["--result", "x"]);
        }
        let (code, printed, error) = run_capturing(&server, &unconfirmed).await;
        assert_eq!(code, 2, "{action} without --yes: {printed}{error}");
        assert!(error.contains("--yes"), "{action}: {error}");
        assert!(
            printed.contains("key:         charge:held"),
            "{action} shows the key it would change: {printed}"
        );
        for (key, scope, expected) in [
            (
                "charge:never",
                None,
                "no key charge:never of consumer worker is stored",
            ),
            (
                "charge:done",
                None,
                "key charge:done of consumer worker is done: there is no lease in progress",
            ),
            (
                "charge:held",
                Some("tenant-a"),
                "no key charge:held of consumer worker in scope tenant-a is stored",
            ),
        ] {
            let mut args = vec!["keys", action, key, "--consumer", "worker", "--yes"];
            args.extend(scope.iter().flat_map(|scope| ["--scope", *scope]));
            let (code, printed, error) = run_capturing(&server, &args).await;
            assert_eq!(code, 1, "{action} {key}: {printed}{error}");
            assert!(error.contains(expected), "{action} {key}: {error}");
            assert!(printed.is_empty(), "{action} {key}: {printed}");
        }
        let (code, _, error) = run_capturing(
            &server,
            &["keys", action, "", "--consumer", "worker", "--yes"],
        )
        .await;
        assert_eq!(code, 2, "{action} of an empty key: {error}");
        assert!(error.contains("invalid key"), "{error}");
    }

    // The held lease is still its worker's, and the done key keeps its result.
    assert!(matches!(
        claim(&worker, "charge:held").await,
        LeaseClaim::InProgress { remaining } if remaining > Duration::from_secs(3000)
    ));
    worker
        .renew(&held, Duration::from_secs(3600))
        .await
        .unwrap();
    worker.complete(&held, b"finished").await.unwrap();
    assert_eq!(
        claim(&worker, "charge:done").await,
        LeaseClaim::Done {
            result: Some(b"receipt".to_vec())
        }
    );
    worker.pool().close().await;
    drop_database(db, &url).await;
}

/// A destination that answers every delivery the same way.
struct Answering(justonce_sql::Delivered);

impl justonce_sql::Destination for Answering {
    fn deliver<'a>(
        &'a self,
        _delivery: justonce_sql::Delivery<'a>,
    ) -> std::pin::Pin<Box<dyn Future<Output = justonce_sql::Delivered> + Send + 'a>> {
        Box::pin(std::future::ready(self.0.clone()))
    }
}

/// Claims `key` for `inbox` in a transaction with one outbox row for `destination`.
pub(crate) async fn claim_with_delivery<DB: TestBackend>(
    inbox: &justonce_sql::Inbox<DB>,
    key: &str,
    destination: &str,
) {
    let key = justonce_sql::Key::new(key).unwrap();
    let mut tx = inbox.begin().await.unwrap();
    let claim = inbox
        .claim(&mut tx, &key, key.as_str().as_bytes())
        .await
        .unwrap();
    assert_eq!(claim, justonce_sql::Claim::First);
    let message = justonce_sql::Message::new(destination, "{}");
    inbox
        .enqueue(&mut tx, &key, "notify", message)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

/// `stats --json` after a known set of claims, leases, deliveries and offsets counts each
/// exactly; the tables say the same, and that duplicates are counted elsewhere.
async fn stats_json_reports_exactly_what_the_store_holds<DB: TestBackend>(test: &str) {
    use justonce_sql::{Consumer, Delivered, Leases, Offset, OffsetCommit, Scope};
    let (db, url, server, worker) = server_and_worker::<DB>(test).await;
    let empty = stats_json(&server).await;
    assert_eq!(
        empty,
        serde_json::json!({
            "keys": [],
            "deliveries": {"sent": 0, "due": 0, "dead": 0},
            "backed_off": [],
            "offsets": [],
        })
    );

    // billing: three keys, two deliveries sent and one dead-lettered.
    let billing = worker.with_consumer(Consumer::new("billing").unwrap());
    claim_with_delivery(&billing, "inv-1", "accepting").await;
    claim_with_delivery(&billing, "inv-2", "accepting").await;
    claim_with_delivery(&billing, "inv-3", "refusing").await;
    let round = billing
        .outbox()
        .relay()
        .destination("accepting", Answering(Delivered::Sent))
        .destination(
            "refusing",
            Answering(Delivered::Reject {
                reason: "400".to_owned(),
            }),
        )
        .relay_once()
        .await
        .unwrap();
    assert_eq!((round.sent, round.dead), (2, 1));
    // billing in tenant-a: a lease held and a lease completed.
    let tenant = billing.with_scope(Scope::new("tenant-a").unwrap());
    acquire(&tenant, "inv-4").await;
    let completed = acquire(&tenant, "inv-5").await;
    tenant.complete(&completed, b"ok").await.unwrap();
    // mail: two keys whose deliveries are due.
    let mail = worker.with_consumer(Consumer::new("mail").unwrap());
    claim_with_delivery(&mail, "welcome-1", "accepting").await;
    claim_with_delivery(&mail, "welcome-2", "accepting").await;
    // reader: two partitions of one stream.
    let reader = worker.with_consumer(Consumer::new("reader").unwrap());
    let mut tx = reader.begin().await.unwrap();
    for (partition, offset) in [(0, Offset::from(41)), (1, Offset::new(7, 2))] {
        let moved = reader
            .commit_offset(&mut tx, "orders", partition, offset)
            .await
            .unwrap();
        assert_eq!(moved, OffsetCommit::Moved);
    }
    tx.commit().await.unwrap();

    assert_eq!(
        stats_json(&server).await,
        serde_json::json!({
            "keys": [
                {"consumer": "billing", "scope": null, "keys": 3, "in_progress": 0},
                {"consumer": "billing", "scope": "tenant-a", "keys": 2, "in_progress": 1},
                {"consumer": "mail", "scope": null, "keys": 2, "in_progress": 0},
            ],
            "deliveries": {"sent": 2, "due": 2, "dead": 1},
            "backed_off": [],
            "offsets": [
                {"consumer": "reader", "stream": "orders", "partition": 0, "position": 41, "sequence": 0},
                {"consumer": "reader", "stream": "orders", "partition": 1, "position": 7, "sequence": 2},
            ],
        })
    );

    let (code, tables) = server.run(&["stats"]).await;
    assert_eq!(code, 0, "{tables}");
    let rows: Vec<Vec<&str>> = tables
        .lines()
        .map(|line| line.split_whitespace().collect())
        .collect();
    for row in [
        vec!["billing", "(none)", "3", "0"],
        vec!["billing", "tenant-a", "2", "1"],
        vec!["mail", "(none)", "2", "0"],
        vec!["reader", "orders", "1", "7", "2"],
    ] {
        assert!(rows.contains(&row), "{row:?} not in\n{tables}");
    }
    assert!(
        rows.iter().any(|row| row.starts_with(&["2", "2", "1"])),
        "deliveries not in\n{tables}"
    );
    assert!(
        tables.contains("Duplicates and key reuses are not stored"),
        "{tables}"
    );

    // A destination that keeps failing is backed off, and the store says so.
    let failing = Answering(Delivered::Retry {
        after: None,
        reason: "503".to_owned(),
    });
    let options = justonce_sql::RelayOptions::default()
        .breaker_failures(1)
        .breaker_pause(Duration::from_secs(600))
        .poll_interval(Duration::from_millis(50));
    let relay = mail
        .outbox()
        .relay()
        .options(options)
        .destination("accepting", failing);
    let running = justonce_tests::RunningRelay::start(relay);
    let mut backed_off = serde_json::Value::Null;
    for _ in 0..100 {
        backed_off = stats_json(&server).await["backed_off"].take();
        if backed_off.as_array().is_some_and(|all| !all.is_empty()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    running.stop().await;
    assert_eq!(backed_off[0]["destination"], "accepting", "{backed_off}");
    assert_eq!(backed_off[0]["failures"], 1, "{backed_off}");
    let pause_left = backed_off[0]["pause_left_seconds"].as_f64().unwrap();
    assert!((500.0..=600.0).contains(&pause_left), "{backed_off}");
    let (code, tables) = server.run(&["stats"]).await;
    assert_eq!(code, 0, "{tables}");
    assert!(
        tables.lines().any(|line| line
            .split_whitespace()
            .take(3)
            .eq(["accepting", "(none)", "1"])),
        "no backed-off destination in\n{tables}"
    );

    // The dead letter replayed, with its progress on standard error.
    let replayed = server
        .command(&["dlq", "replay", "--all"])
        .stderr(Stdio::piped())
        .output()
        .await
        .unwrap();
    assert!(replayed.status.success());
    let stdout = String::from_utf8_lossy(&replayed.stdout);
    assert_eq!(stdout.trim(), "1 dead letter is due again");
    let stderr = String::from_utf8_lossy(&replayed.stderr);
    assert!(
        stderr.contains("dead letters: 1 of 1 due again"),
        "{stderr}"
    );
    assert_eq!(
        stats_json(&server).await["deliveries"],
        serde_json::json!({"sent": 2, "due": 3, "dead": 0})
    );
    worker.pool().close().await;
    drop_database(db, &url).await;
}
