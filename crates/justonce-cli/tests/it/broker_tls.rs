//! `serve` consuming each broker over TLS, a throwaway server of the test's own that speaks
//! only TLS: with another CA in `tls_ca` it exits 2 at start, naming the consumer and the
//! setting, and so does `check`; with the right one, `check` reaches the broker and messages
//! published twice over TLS reach the target once per key. With `tls_verify = "insecure"` it
//! consumes and warns at start. A Kafka SCRAM login: a wrong password exits 2 at start, the
//! right one consumes.

use super::serve::{
    Server, all_delivered, client, database, drop_database, run_capturing, serve_exits_2_at_start,
};
use justonce_sql::sqlx::Sqlite;
use justonce_sql::{Delivered, Delivery, Destination};
use justonce_tests::Sink;
use justonce_tests::servers::{Kind, TlsBroker};
use justonce_tests::tls::TestCa;
use justonce_transport::amqp::AmqpDestination;
use justonce_transport::kafka::{IDEMPOTENCY_KEY_HEADER, KafkaDestination, Sasl, SaslMechanism};
use justonce_transport::mqtt::MqttDestination;
use justonce_transport::nats::NatsDestination;
use justonce_transport::redis_streams::RedisStreamDestination;
use justonce_transport::tls::Tls;
use std::collections::HashMap;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_consumes_redis_over_tls_and_exits_2_with_another_ca() {
    consumes_over_tls_and_exits_2_with_another_ca(Kind::Redis, "redis-tls").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_consumes_mqtt_over_tls_and_exits_2_with_another_ca() {
    consumes_over_tls_and_exits_2_with_another_ca(Kind::Mosquitto, "mqtt-tls").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_consumes_nats_over_tls_and_exits_2_with_another_ca() {
    consumes_over_tls_and_exits_2_with_another_ca(Kind::Nats, "nats-tls").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_consumes_rabbitmq_over_tls_and_exits_2_with_another_ca() {
    consumes_over_tls_and_exits_2_with_another_ca(Kind::RabbitMq, "rabbitmq-tls").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_consumes_kafka_over_tls_and_exits_2_with_another_ca() {
    consumes_over_tls_and_exits_2_with_another_ca(Kind::Kafka, "kafka-tls").await
}

/// The queue, stream or topic every test consumes: each broker is the test's own.
const NAME: &str = "orders";

/// The consumer `orders` of `url`, with the TLS settings `tls`.
fn consumer(kind: Kind, url: &str, tls: &str, target: &str) -> String {
    let source = match kind {
        Kind::Redis => format!("stream = \"{NAME}\""),
        Kind::Mosquitto => format!("topic = \"{NAME}\"\nclient_id = \"justonce-{NAME}\""),
        Kind::Nats => format!("stream = \"{NAME}\""),
        Kind::RabbitMq => format!("queue = \"{NAME}\""),
        Kind::Kafka => format!(
            "topic = \"{NAME}\"\ngroup = \"{NAME}\"\nid = \"header:{IDEMPOTENCY_KEY_HEADER}\""
        ),
    };
    format!("[consumers.orders]\nfrom = \"{url}\"\n{source}\n{tls}\ntarget = \"{target}\"\n")
}

fn tls_ca(ca: &Path) -> String {
    format!("tls_ca = \"{}\"", ca.display())
}

/// The relay's publisher for the broker, over TLS trusting `ca`.
fn publisher(kind: Kind, url: &str, ca: &Path) -> Box<dyn Destination> {
    let tls = Tls::default().with_ca(std::fs::read(ca).unwrap()).unwrap();
    match kind {
        Kind::Redis => Box::new(RedisStreamDestination::new(url, NAME).unwrap().tls(tls)),
        Kind::Mosquitto => Box::new(
            MqttDestination::new(url, NAME, "test-publisher")
                .unwrap()
                .tls(tls),
        ),
        Kind::Nats => Box::new(NatsDestination::new(url, NAME).tls(tls)),
        Kind::RabbitMq => Box::new(AmqpDestination::new(url, "", NAME).tls(tls)),
        Kind::Kafka => Box::new(KafkaDestination::new(url, NAME).tls(tls)),
    }
}

async fn consumes_over_tls_and_exits_2_with_another_ca(kind: Kind, test: &str) {
    let ca = TestCa::new();
    let broker = TlsBroker::start(kind, &ca, false).expect("a broker of the test's own");
    if kind == Kind::Kafka {
        broker.create_kafka_topic(&ca, NAME).await;
    }
    let (db, url) = database::<Sqlite>(test).await;
    let sink = Sink::start().await;

    let another_ca = TestCa::new();
    let settings = consumer(
        kind,
        &broker.url(),
        &tls_ca(&another_ca.ca_file()),
        &sink.url(),
    );
    let server = Server::configure_with(&url, &sink.url(), &settings);
    let stderr = serve_exits_2_at_start(&server, &[]).await;
    assert!(
        stderr.contains(
            "consumers.orders: cannot connect over TLS: the broker's certificate is not signed \
             by a trusted CA; check consumers.orders.tls_ca"
        ),
        "{stderr}"
    );
    // `check` refuses the same setting with the same exit code, naming the consumer.
    let (code, stdout, stderr) = run_capturing(&server, &["check"]).await;
    assert_eq!(code, 2, "{stdout}{stderr}");
    assert!(
        stderr.contains(&format!(
            "consumer orders: {}: cannot connect over TLS: the broker's certificate is not \
             signed by a trusted CA; check consumers.orders.tls_ca",
            broker.url().replacen("guest:guest@", "guest:***@", 1)
        )),
        "{stderr}"
    );
    drop(server);

    let settings = consumer(kind, &broker.url(), &tls_ca(&ca.ca_file()), &sink.url());
    let mut server = Server::configure_with(&url, &sink.url(), &settings);
    let (code, stdout, stderr) = run_capturing(&server, &["check"]).await;
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("1 consumer, 1 broker reached"), "{stdout}");
    server.start().await;
    await_ready(&server).await;
    each_key_reaches_the_target_once(
        &server,
        &sink,
        &*publisher(kind, &broker.url(), &ca.ca_file()),
    )
    .await;
    server.stop().await;
    drop_database(db, &url).await;
}

/// A hosted Kafka's login in `serve`'s settings, against a broker that requires TLS and a
/// SCRAM login: with a wrong password `serve` exits 2 at start, naming the consumer and the
/// refused login; with the right one, each key published twice reaches the target once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_consumes_kafka_with_a_scram_login_and_exits_2_with_a_wrong_password() {
    let ca = TestCa::new();
    let broker = TlsBroker::start_kafka_with_scram_user(&ca, "billing", "right-password")
        .expect("a broker of the test's own");
    broker.create_kafka_topic(&ca, NAME).await;
    let (db, url) = database::<Sqlite>("kafka-sasl").await;
    let sink = Sink::start().await;
    let login = format!(
        "{}\nsasl_mechanism = \"SCRAM-SHA-512\"\nsasl_username = \"billing\"\n\
         sasl_password = \"env:KAFKA_PASSWORD\"",
        tls_ca(&ca.ca_file())
    );
    let settings = consumer(Kind::Kafka, &broker.url(), &login, &sink.url());
    let mut server = Server::configure_with(&url, &sink.url(), &settings);

    let stderr = serve_exits_2_at_start(&server, &[("KAFKA_PASSWORD", "wrong-password")]).await;
    assert!(
        stderr.contains(
            "consumers.orders: invalid configuration: the brokers refused the SASL login ("
        ),
        "{stderr}"
    );

    let _logs = server
        .start_logged(&[], &[("KAFKA_PASSWORD", "right-password")])
        .await;
    await_ready(&server).await;
    let tls = Tls::default()
        .with_ca(std::fs::read(ca.ca_file()).unwrap())
        .unwrap();
    let publisher = KafkaDestination::new(&broker.url(), NAME)
        .tls(tls)
        .sasl(Sasl::new(
            SaslMechanism::ScramSha512,
            "billing",
            "right-password",
        ));
    each_key_reaches_the_target_once(&server, &sink, &publisher).await;
    server.stop().await;
    drop_database(db, &url).await;
}

/// Publishes ten keys twice each through `publisher`: each reaches the target once.
async fn each_key_reaches_the_target_once(
    server: &Server,
    sink: &Sink,
    publisher: &dyn Destination,
) {
    for n in 0..20 {
        let key = format!("order-{}", n % 10);
        let delivery = Delivery {
            id: n,
            key: &key,
            destination: NAME,
            payload: key.as_bytes(),
            headers: &[],
            attempt: 1,
        };
        assert_eq!(publisher.deliver(delivery).await, Delivered::Sent, "{key}");
    }
    let by_key = delivered_once(server, sink, 10).await;
    for n in 0..10 {
        assert_eq!(by_key[&format!("orders:order-{n}")], 1, "order-{n}");
    }
}

/// Waits until `/readyz` says every consumer is connected.
async fn await_ready(server: &Server) {
    let client = client();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let ready = client.get(format!("{}/readyz", server.public)).send().await;
        if ready.is_ok_and(|r| r.status().is_success()) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the consumer did not connect"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How often the sink received each key, once `server` has delivered `keys` events: the
/// relay sends nothing more after that.
async fn delivered_once(server: &Server, sink: &Sink, keys: usize) -> HashMap<String, usize> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let count = || {
        let mut by_key = HashMap::new();
        for request in sink.received() {
            *by_key.entry(request.key.unwrap_or_default()).or_default() += 1;
        }
        by_key
    };
    while count().len() < keys {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not every key reached the target: {:?}",
            count()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    all_delivered(server, keys).await;
    let by_key = count();
    assert_eq!(by_key.len(), keys, "{by_key:?}");
    by_key
}

/// `tls_verify = "insecure"`: `serve` warns at start, naming the consumer, and consumes from
/// a broker whose CA it was never given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_warns_at_start_that_an_insecure_consumer_checks_no_certificate() {
    let ca = TestCa::new();
    let broker = TlsBroker::start(Kind::Redis, &ca, false).expect("a Redis of the test's own");
    let (db, url) = database::<Sqlite>("insecure-tls").await;
    let sink = Sink::start().await;
    let settings = consumer(
        Kind::Redis,
        &broker.url(),
        "tls_verify = \"insecure\"",
        &sink.url(),
    );
    let server = Server::configure_with(&url, &sink.url(), &settings);
    let mut serve = server
        .command(&["serve"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    await_ready(&server).await;
    let publisher = publisher(Kind::Redis, &broker.url(), &ca.ca_file());
    let delivery = Delivery {
        id: 1,
        key: "order-1",
        destination: NAME,
        payload: b"order-1",
        headers: &[],
        attempt: 1,
    };
    assert_eq!(publisher.deliver(delivery).await, Delivered::Sent);
    assert_eq!(delivered_once(&server, &sink, 1).await["orders:order-1"], 1);
    serve.start_kill().unwrap();
    let output = serve.wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("tls_verify = \"insecure\": the broker's certificate is not checked")
            && stderr.contains("orders"),
        "{stderr}"
    );
    drop_database(db, &url).await;
}

/// A TLS broker that is down at start is not a certificate problem: `serve` stays up, says
/// the consumer is not connected, and keeps trying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_keeps_trying_a_tls_broker_that_is_down() {
    let ca = TestCa::new();
    let nowhere = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (db, url) = database::<Sqlite>("down-tls").await;
    let sink = Sink::start().await;
    let settings = consumer(
        Kind::Redis,
        &format!("rediss://127.0.0.1:{nowhere}"),
        &tls_ca(&ca.ca_file()),
        &sink.url(),
    );
    let mut server = Server::configure_with(&url, &sink.url(), &settings);
    server.start().await;
    let client = client();
    // Past the first connection attempt and a retry.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let ready = client
        .get(format!("{}/readyz", server.public))
        .send()
        .await
        .expect("serve is still up");
    assert_eq!(ready.status(), 503);
    let body = ready.text().await.unwrap();
    assert!(body.contains("not connected"), "{body}");
    server.stop().await;
    drop_database(db, &url).await;
}
