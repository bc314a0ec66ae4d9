//! `serve` against hostile clients and a database outage: slow headers, more connections
//! than open files, PostgreSQL killed under it. Each answer is timed from the client.

use super::serve::{Server, client, database, drop_database, post};
use justonce_tests::Sink;
use justonce_tests::cluster::Cluster;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

type Sqlite = justonce_sql::sqlx::Sqlite;

/// Posts one signed event and returns the whole answer.
async fn signed_post(
    client: &reqwest::Client,
    server: &str,
    body: &str,
) -> reqwest::Result<reqwest::Response> {
    client
        .post(format!("{server}/webhooks/demo"))
        .header("x-signature", super::serve::signature(body))
        .body(body.to_owned())
        .timeout(Duration::from_secs(30))
        .send()
        .await
}

/// Reads until the server closes the connection; how long that took.
async fn closed_after(mut stream: TcpStream, opened: Instant, limit: Duration) -> Duration {
    let mut buffer = [0; 1024];
    loop {
        match tokio::time::timeout_at((opened + limit).into(), stream.read(&mut buffer)).await {
            Ok(Ok(0) | Err(_)) => return opened.elapsed(),
            Ok(Ok(_)) => {}
            Err(_) => panic!("the server held a slow client for {limit:?}"),
        }
    }
}

/// 300 clients that send half a request's headers and then nothing are closed by the
/// server within its header timeout, and a POST sent meanwhile is answered at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_closed_within_the_header_timeout_while_others_are_answered() {
    let (db, url) = database::<Sqlite>("slow-headers").await;
    let sink = Sink::start().await;
    let mut server = Server::configure_all(&url, &sink.url(), "header_timeout = \"2s\"", "");
    server.start().await;
    let address = server.public.trim_start_matches("http://").to_owned();
    let opened = Instant::now();
    let mut slow = Vec::new();
    for _ in 0..300 {
        let mut stream = TcpStream::connect(&address).await.unwrap();
        stream
            .write_all(b"POST /webhooks/demo HTTP/1.1\r\nHost: test\r\nContent-Type: applica")
            .await
            .unwrap();
        slow.push(stream);
    }
    let client = client();
    let started = Instant::now();
    let answer = post(&client, &server.public, r#"{"id":"evt_1"}"#)
        .await
        .unwrap();
    let answered = started.elapsed();
    assert_eq!(answer, (200, "accepted".to_owned()));
    assert!(
        answered < Duration::from_secs(1),
        "answered after {answered:?}"
    );
    let waits = slow
        .into_iter()
        .map(|stream| tokio::spawn(closed_after(stream, opened, Duration::from_secs(8))));
    let mut longest = Duration::ZERO;
    for wait in waits {
        longest = longest.max(wait.await.unwrap());
    }
    eprintln!("slow clients: all 300 closed within {longest:?}; a POST answered in {answered:?}");
    // The timeout is 2 s; the margin is for 300 connections opened one after another.
    assert!(longest < Duration::from_secs(5), "{longest:?}");
    server.stop().await;
    drop_database(db, &url).await;
}

/// With 1,024 open files and 1,100 idle connections held, `serve` stays up: a new POST is
/// answered, with a 503 and `Retry-After` while the connections are held, and with 200 once
/// they are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_connections_than_open_files_leave_the_server_answering() {
    let (db, url) = database::<Sqlite>("open-files").await;
    let sink = Sink::start().await;
    let mut server = Server::configure_all(&url, &sink.url(), "header_timeout = \"60s\"", "");
    server.open_files = Some(1024);
    server.start().await;
    let address = server.public.trim_start_matches("http://").to_owned();
    let mut idle = Vec::new();
    for _ in 0..1_100 {
        idle.push(TcpStream::connect(&address).await.unwrap());
    }
    // The connections over the cap were answered 503 and closed; give those answers time.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let client = client();
    let started = Instant::now();
    let response = signed_post(&client, &server.public, r#"{"id":"evt_1"}"#)
        .await
        .expect("an answer while 1,100 connections are held");
    let answered = started.elapsed();
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["retry-after"], "1");
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    assert!(
        answered < Duration::from_secs(3),
        "answered after {answered:?}"
    );
    let live = client
        .get(format!("{}/livez", server.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(live.status(), 200, "the admin listener has its own cap");
    drop(idle);
    let mut accepted = None;
    for _ in 0..100 {
        if let Ok(answer) = post(&client, &server.public, r#"{"id":"evt_1"}"#).await
            && answer.0 == 200
        {
            accepted = Some(answer);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(accepted, Some((200, "accepted".to_owned())));
    eprintln!(
        "1,100 idle connections at 1,024 open files: a POST refused with 503 in {answered:?}"
    );
    server.stop().await;
    drop_database(db, &url).await;
}

/// GETs `url` and returns the status, the body and how long the answer took.
async fn timed_get(client: &reqwest::Client, url: &str) -> (u16, String, Duration) {
    let started = Instant::now();
    let response = client
        .get(url)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let body = response.text().await.unwrap();
    (status, body, started.elapsed())
}

/// PostgreSQL killed under a running `serve`: a webhook is refused with 503 and
/// `Retry-After` within 3 s, `/livez` answers from memory, `/readyz` names the database,
/// `/metrics` answers within a second with `justonce_store_up 0`; with PostgreSQL back,
/// `/readyz` returns to 200 by itself and the event is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_postgres_down_webhooks_are_refused_at_once_and_probes_answer() {
    let cluster = tokio::task::spawn_blocking(Cluster::start)
        .await
        .unwrap()
        .expect("a throwaway PostgreSQL cluster");
    let sink = Sink::start().await;
    let mut server = Server::configure(&cluster.url(), &sink.url());
    let logs = server.start_logged(&["--log-format", "json"], &[]).await;
    let client = client();
    assert_eq!(
        post(&client, &server.public, r#"{"id":"evt_1"}"#)
            .await
            .unwrap(),
        (200, "accepted".to_owned())
    );
    let metrics = format!("{}/metrics", server.admin);
    let store_up = |value: &'static str| {
        let (client, metrics) = (client.clone(), metrics.clone());
        async move {
            for _ in 0..100 {
                let (status, body, took) = timed_get(&client, &metrics).await;
                assert_eq!(status, 200);
                assert!(took < Duration::from_secs(1), "/metrics took {took:?}");
                if body
                    .lines()
                    .any(|line| line == format!("justonce_store_up {value}"))
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            panic!("justonce_store_up never became {value}");
        }
    };
    store_up("1").await;

    let stop = tokio::task::spawn_blocking(move || {
        cluster.stop_immediately().unwrap();
        cluster
    });
    let cluster = stop.await.unwrap();
    let started = Instant::now();
    let refused = signed_post(&client, &server.public, r#"{"id":"evt_2"}"#)
        .await
        .unwrap();
    let refused_after = started.elapsed();
    assert_eq!(refused.status(), 503);
    assert!(refused.headers().contains_key("retry-after"));
    assert!(refused_after < Duration::from_secs(3), "{refused_after:?}");
    // More refusals at once: the log says it once.
    let refusing = (3..8).map(|n| {
        let (client, public) = (client.clone(), server.public.clone());
        tokio::spawn(async move {
            let body = format!(r#"{{"id":"evt_{n}"}}"#);
            signed_post(&client, &public, &body).await.unwrap().status()
        })
    });
    for refused in refusing.collect::<Vec<_>>() {
        assert_eq!(refused.await.unwrap(), 503);
    }

    let mut fastest = Duration::MAX;
    for _ in 0..3 {
        let (status, _, took) = timed_get(&client, &format!("{}/livez", server.public)).await;
        assert_eq!(status, 200);
        fastest = fastest.min(took);
    }
    assert!(
        fastest < Duration::from_millis(100),
        "/livez took {fastest:?}"
    );
    let (status, body, took) = timed_get(&client, &format!("{}/readyz", server.public)).await;
    assert_eq!(status, 503);
    assert!(body.contains("the database"), "{body}");
    assert!(took < Duration::from_millis(1_500), "/readyz took {took:?}");
    store_up("0").await;
    eprintln!(
        "PostgreSQL down: a webhook refused in {refused_after:?}, /livez in {fastest:?}, \
         /readyz in {took:?}"
    );

    let cluster = tokio::task::spawn_blocking(move || {
        cluster.start_again().unwrap();
        cluster
    })
    .await
    .unwrap();
    let mut ready = false;
    for _ in 0..150 {
        let (status, _, _) = timed_get(&client, &format!("{}/readyz", server.public)).await;
        if status == 200 {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        ready,
        "/readyz did not return to 200 once PostgreSQL was back"
    );
    assert_eq!(
        post(&client, &server.public, r#"{"id":"evt_2"}"#)
            .await
            .unwrap(),
        (200, "accepted".to_owned())
    );
    server.stop().await;
    drop(cluster);
    let lines = logs.await.unwrap();
    let all = lines.join("\n");
    let with = |message: &str| {
        lines
            .iter()
            .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
            .filter(|line| line["message"] == message)
            .collect::<Vec<_>>()
    };
    let unavailable = with("webhook rejected");
    assert_eq!(unavailable.len(), 1, "{all}");
    assert_eq!(unavailable[0]["kind"], "unavailable");
    assert!(unavailable[0]["error"].is_string(), "{all}");
    assert_eq!(
        with("taking due rows failed: trying again").len(),
        1,
        "{all}"
    );
}

/// A consumer whose broker is down keeps `/readyz` at 503, naming the consumer and the
/// cause in its detail and as members (the state, the last error), and the console's
/// consumers page shows both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_names_a_consumer_that_cannot_connect() {
    let (db, url) = database::<Sqlite>("readyz-consumer").await;
    let broker = format!(
        "amqp://guest:guest@127.0.0.1:{}/%2f",
        super::serve::free_port()
    );
    let consumer = format!(
        "[consumers.orders]\nfrom = \"{broker}\"\nqueue = \"{}orders\"\ntarget = \"http://127.0.0.1:1/x\"\n",
        db.prefix
    );
    let mut server = Server::configure_with(&url, "http://127.0.0.1:1/x", &consumer);
    server.start().await;
    let client = client();
    let (problem, named) = readyz_naming_a_consumer(&server, 100).await;
    let detail = problem["detail"].as_str().unwrap();
    assert!(
        detail.contains("consumer orders: not connected: ")
            && detail.contains("Connection refused"),
        "{named}"
    );
    assert_eq!(problem["database"], "up", "{named}");
    assert_eq!(problem["consumers"]["orders"], "connecting", "{named}");
    let last_error = problem["last_errors"]["orders"].as_str().unwrap();
    assert!(last_error.contains("Connection refused"), "{named}");
    let (_, page, _) = timed_get(&client, &format!("{}/consumers", server.admin)).await;
    assert!(
        page.contains("<tr data-consumer=\"orders\">")
            && page.contains("not connected: ")
            && page.contains("Connection refused"),
        "{page}"
    );
    server.stop().await;
    drop_database(db, &url).await;
}

/// A consumer whose broker connection breaks turns `/readyz` to 503, naming it as
/// connecting with the error that lost it, and connects again by itself: `/readyz` returns
/// to 200 and `justonce_broker_reconnects_total` counts it, without the service restarting
/// anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_names_a_consumer_while_it_connects_again_after_losing_its_broker() {
    let (db, url) = database::<Sqlite>("readyz-reconnect").await;
    let proxy = justonce_tests::BreakableRedis::start().await;
    // The stream under keys of this test's own, deleted at the end.
    let redis = justonce_tests::TestRedis::new("readyz-reconnect").await;
    let consumer = format!(
        "[consumers.orders]\nfrom = \"{}\"\nstream = \"{}orders\"\ntarget = \"http://127.0.0.1:1/x\"\n",
        proxy.url(),
        redis.prefix
    );
    let mut server = Server::configure_with(&url, "http://127.0.0.1:1/x", &consumer);
    server.start().await;
    let client = client();
    let within = Duration::from_secs(15);
    readyz_answers(&client, &server, 200, within).await;
    proxy.set_up(false);
    let named = readyz_answers(&client, &server, 503, within).await;
    assert_connecting_again(&named);
    proxy.set_up(true);
    readyz_answers(&client, &server, 200, within).await;
    assert_reconnect_counted(&client, &server).await;
    server.stop().await;
    redis.cleanup().await;
    drop_database(db, &url).await;
}

/// The body of the first `/readyz` answer with status `wanted`, asked every 100 ms for up
/// to `within`.
async fn readyz_answers(
    client: &reqwest::Client,
    server: &Server,
    wanted: u16,
    within: Duration,
) -> String {
    let readyz = format!("{}/readyz", server.admin);
    let given_up = Instant::now() + within;
    while Instant::now() < given_up {
        let (status, body, _) = timed_get(client, &readyz).await;
        if status == wanted {
            return body;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("/readyz did not answer {wanted} within {within:?}");
}

/// `named`, a 503 of `/readyz`, names consumer `orders` as connecting, with its last error.
fn assert_connecting_again(named: &str) {
    let problem: serde_json::Value = serde_json::from_str(named).unwrap();
    assert_eq!(problem["consumers"]["orders"], "connecting", "{named}");
    assert!(problem["last_errors"]["orders"].is_string(), "{named}");
}

/// `/metrics` counts a reconnection of consumer `orders`.
async fn assert_reconnect_counted(client: &reqwest::Client, server: &Server) {
    let (_, metrics, _) = timed_get(client, &format!("{}/metrics", server.admin)).await;
    let reconnected = metrics.lines().any(|line| {
        line.starts_with("justonce_broker_reconnects_total{")
            && line.contains("consumer=\"orders\"")
            && !line.ends_with(" 0")
    });
    assert!(reconnected, "{metrics}");
}

/// The Kafka client connects again by itself, so only its own signals tell that its broker
/// went: while the consumer's broker is killed, `/readyz` names the consumer as connecting;
/// once the broker is started again, `/readyz` answers 200 and the reconnection is counted.
/// The broker is one of the test's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_names_a_kafka_consumer_connecting_while_its_broker_is_away() {
    let (db, url) = database::<Sqlite>("readyz-kafka-away").await;
    let mut broker = justonce_tests::OwnBroker::start("kafka").await.unwrap();
    let topic = format!("{}orders", db.prefix);
    justonce_tests::create_kafka_topic(&broker.url(), &topic, 1).await;
    let consumer = format!(
        "[consumers.orders]\nfrom = \"{}\"\ntopic = \"{topic}\"\nid = \"header:ce_id\"\n\
         target = \"http://127.0.0.1:1/x\"\n",
        broker.url()
    );
    let mut server = Server::configure_with(&url, "http://127.0.0.1:1/x", &consumer);
    server.start().await;
    let client = client();
    // The client tries its broker again after at most 10 s (librdkafka's longest backoff).
    let within = Duration::from_secs(30);
    readyz_answers(&client, &server, 200, within).await;
    broker.kill().await.unwrap();
    let named = readyz_answers(&client, &server, 503, within).await;
    assert_connecting_again(&named);
    broker.start_again().await.unwrap();
    readyz_answers(&client, &server, 200, within).await;
    assert_reconnect_counted(&client, &server).await;
    server.stop().await;
    drop_database(db, &url).await;
}

/// A Kafka client reaches its brokers only once it reads: a consumer whose brokers do not
/// answer is not connected, and `/readyz` stays at 503 until it names the consumer's last
/// error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_never_reports_connected_a_kafka_consumer_whose_brokers_do_not_answer() {
    let (db, url) = database::<Sqlite>("readyz-kafka").await;
    let nowhere = super::serve::free_port();
    let consumer = format!(
        "[consumers.orders]\nfrom = \"kafka://127.0.0.1:{nowhere}\"\ntopic = \"{}orders\"\n\
         id = \"header:ce_id\"\ntarget = \"http://127.0.0.1:1/x\"\n",
        db.prefix
    );
    let mut server = Server::configure_with(&url, "http://127.0.0.1:1/x", &consumer);
    server.start().await;
    // Past the probe's 5 s.
    let (problem, named) = readyz_naming_a_consumer(&server, 150).await;
    assert_eq!(problem["consumers"]["orders"], "connecting", "{named}");
    assert!(problem["last_errors"]["orders"].is_string(), "{named}");
    server.stop().await;
    drop_database(db, &url).await;
}

/// A RabbitMQ consumer on a port that takes connections and never answers gives its
/// connection up after 15 s: `/readyz` names the consumer with that error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_names_a_rabbitmq_consumer_whose_broker_never_answers() {
    let (db, url) = database::<Sqlite>("readyz-silent-amqp").await;
    // The kernel completes the handshakes; nothing ever reads or writes.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let consumer = format!(
        "[consumers.orders]\nfrom = \"amqp://guest:guest@127.0.0.1:{port}/%2f\"\n\
         queue = \"{}orders\"\ntarget = \"http://127.0.0.1:1/x\"\n",
        db.prefix
    );
    let mut server = Server::configure_with(&url, "http://127.0.0.1:1/x", &consumer);
    server.start().await;
    let (problem, named) = readyz_naming_a_consumer(&server, 300).await;
    assert_eq!(problem["consumers"]["orders"], "connecting", "{named}");
    let last_error = problem["last_errors"]["orders"].as_str().unwrap();
    assert!(last_error.contains("no connection within 15 s"), "{named}");
    server.stop().await;
    drop(silent);
    drop_database(db, &url).await;
}

/// `/readyz`'s problem, and its text, once it names a consumer not connected; asked every
/// 100 ms, at most `tries` times. Every answer until then is a 503.
async fn readyz_naming_a_consumer(server: &Server, tries: usize) -> (serde_json::Value, String) {
    let client = client();
    for _ in 0..tries {
        let (status, body, _) = timed_get(&client, &format!("{}/readyz", server.admin)).await;
        assert_eq!(status, 503, "{body}");
        if body.contains("not connected:") {
            return (serde_json::from_str(&body).unwrap(), body);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("/readyz named no consumer's error in {tries} tries");
}
