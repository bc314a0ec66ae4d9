//! Every broker over TLS, each a throwaway server of the test's own that speaks only TLS
//! with a certificate of the test's CA: with the right CA, messages the relay's publisher
//! sends over TLS are consumed over TLS and take effect once per key; with another CA, the
//! consumer and the publisher fail with a certificate error, not as a broker that is down.

use super::broker::{Consume, consume_until};
use justonce_sql::{Delivered, Delivery, Destination, Key};
use justonce_tests::servers::{Kind, TlsBroker};
use justonce_tests::tls::TestCa;
use justonce_tests::{KAFKA_SESSION_TIMEOUT, TestDb, unique};
use justonce_transport::KeyFrom;
use justonce_transport::amqp::{AmqpConsumer, AmqpDestination, AmqpOptions};
use justonce_transport::kafka::{
    IDEMPOTENCY_KEY_HEADER, KafkaDestination, KafkaOptions, KafkaReader, Sasl, SaslMechanism,
};
use justonce_transport::mqtt::{MqttConsumer, MqttDestination, MqttOptions};
use justonce_transport::nats::{NatsConsumer, NatsDestination, NatsOptions};
use justonce_transport::redis_streams::{
    RedisStreamConsumer, RedisStreamDestination, RedisStreamOptions,
};
use justonce_transport::tls::{Tls, TlsError};
use justonce_transport::{ConsumerStats, Error, Link};
use sqlx::Sqlite;
use std::sync::atomic::Ordering;

/// What the test does on one broker: its consumer and its publisher, with TLS settings.
trait Broker {
    type Consumer: Consume<Sqlite>;
    const KIND: Kind;
    /// What consuming `order:0`, `order:0`, `order:1` counts: a NATS stream drops the
    /// repeat of a `Nats-Msg-Id` itself.
    const COUNTED: (u64, u64) = (2, 1);

    async fn connect(url: &str, db: &TestDb<Sqlite>, tls: Tls) -> Result<Self::Consumer, Error>;
    fn publisher(url: &str, name: &str, tls: Tls) -> Box<dyn Destination>;

    /// Makes the queue, stream or topic `name` that publishers need ready on `broker`.
    async fn prepare(_broker: &TlsBroker, _ca: &TestCa, _name: &str) {}
}

struct Redis;
impl Broker for Redis {
    type Consumer = RedisStreamConsumer<Sqlite>;
    const KIND: Kind = Kind::Redis;
    async fn connect(url: &str, db: &TestDb<Sqlite>, tls: Tls) -> Result<Self::Consumer, Error> {
        let options = RedisStreamOptions::new(name(db), "test").tls(tls);
        RedisStreamConsumer::connect(url, db.inbox.clone(), options).await
    }
    fn publisher(url: &str, name: &str, tls: Tls) -> Box<dyn Destination> {
        Box::new(RedisStreamDestination::new(url, name).unwrap().tls(tls))
    }
}

struct Mosquitto;
impl Broker for Mosquitto {
    type Consumer = MqttConsumer<Sqlite>;
    const KIND: Kind = Kind::Mosquitto;
    async fn connect(url: &str, db: &TestDb<Sqlite>, tls: Tls) -> Result<Self::Consumer, Error> {
        let options = MqttOptions::new(name(db), format!("{}-c", name(db))).tls(tls);
        MqttConsumer::connect(url, db.inbox.clone(), options).await
    }
    fn publisher(url: &str, name: &str, tls: Tls) -> Box<dyn Destination> {
        let client_id = format!("{name}-p{}", unique());
        Box::new(
            MqttDestination::new(url, name, &client_id)
                .unwrap()
                .tls(tls),
        )
    }
}

struct Nats;
impl Broker for Nats {
    type Consumer = NatsConsumer<Sqlite>;
    const KIND: Kind = Kind::Nats;
    const COUNTED: (u64, u64) = (2, 0);
    async fn connect(url: &str, db: &TestDb<Sqlite>, tls: Tls) -> Result<Self::Consumer, Error> {
        let options = NatsOptions::new(name(db), name(db)).tls(tls);
        NatsConsumer::connect(url, db.inbox.clone(), options).await
    }
    fn publisher(url: &str, name: &str, tls: Tls) -> Box<dyn Destination> {
        Box::new(NatsDestination::new(url, name).tls(tls))
    }
}

struct RabbitMq;
impl Broker for RabbitMq {
    type Consumer = AmqpConsumer<Sqlite>;
    const KIND: Kind = Kind::RabbitMq;
    async fn connect(url: &str, db: &TestDb<Sqlite>, tls: Tls) -> Result<Self::Consumer, Error> {
        let options = AmqpOptions::new(name(db)).tls(tls);
        AmqpConsumer::connect(url, db.inbox.clone(), options).await
    }
    fn publisher(url: &str, name: &str, tls: Tls) -> Box<dyn Destination> {
        Box::new(AmqpDestination::new(url, "", name).tls(tls))
    }
}

struct Kafka;
impl Broker for Kafka {
    type Consumer = KafkaReader<Sqlite>;
    const KIND: Kind = Kind::Kafka;
    /// Connects as `serve` does: a member reaches the brokers only once it reads, so the
    /// probe proves the settings first.
    async fn connect(url: &str, db: &TestDb<Sqlite>, tls: Tls) -> Result<Self::Consumer, Error> {
        let options = kafka_options(db).tls(tls);
        justonce_transport::kafka::probe(url, &options).await?;
        KafkaReader::connect(url, db.inbox.clone(), options)
    }
    fn publisher(url: &str, name: &str, tls: Tls) -> Box<dyn Destination> {
        Box::new(KafkaDestination::new(url, name).tls(tls))
    }
    async fn prepare(broker: &TlsBroker, ca: &TestCa, name: &str) {
        broker.create_kafka_topic(ca, name).await
    }
}

fn kafka_options(db: &TestDb<Sqlite>) -> KafkaOptions {
    KafkaOptions::new(name(db), name(db))
        .key_from(KeyFrom::Header(IDEMPOTENCY_KEY_HEADER.into()))
        .session_timeout(KAFKA_SESSION_TIMEOUT)
}

/// The queue, stream or topic of a test: on a broker of its own, any name will do.
fn name(db: &TestDb<Sqlite>) -> String {
    format!("{}orders", db.prefix)
}

fn trusting(ca: &TestCa) -> Tls {
    Tls::default()
        .with_ca(std::fs::read(ca.ca_file()).unwrap())
        .unwrap()
}

async fn publish(publisher: &dyn Destination, key: &str) -> Delivered {
    let delivery = Delivery {
        id: 1,
        key,
        destination: "orders",
        payload: key.as_bytes(),
        headers: &[],
        attempt: 1,
    };
    publisher.deliver(delivery).await
}

async fn consumed_over_tls_once_and_refused_with_another_ca<B: Broker>(test: &str) {
    let ca = TestCa::new();
    let broker = TlsBroker::start(B::KIND, &ca, false).expect("a broker of the test's own");
    let url = broker.url();
    let db = TestDb::<Sqlite>::new(test).await;
    B::prepare(&broker, &ca, &name(&db)).await;

    let another_ca = trusting(&TestCa::new());
    let refused = B::connect(&url, &db, another_ca.clone()).await.err();
    assert!(
        matches!(refused, Some(Error::Tls(TlsError::UnknownIssuer))),
        "{refused:?}"
    );
    assert_eq!(
        refused.unwrap().to_string(),
        "TLS: the broker's certificate is not signed by a trusted CA"
    );
    let Delivered::Retry { reason, .. } =
        publish(&*B::publisher(&url, &name(&db), another_ca), "order:0").await
    else {
        panic!("a publisher that does not trust the broker's CA sent a message");
    };
    assert!(
        reason.contains("the broker's certificate is not signed by a trusted CA"),
        "{reason}"
    );

    let consumer = B::connect(&url, &db, trusting(&ca))
        .await
        .expect("connected with the right CA");
    let publisher = B::publisher(&url, &name(&db), trusting(&ca));
    for key in ["order:0", "order:0", "order:1"] {
        assert_eq!(publish(&*publisher, key).await, Delivered::Sent, "{key}");
    }
    let last = Key::new("order:1").unwrap();
    let stats: ConsumerStats =
        consume_until(&db, &consumer, || async { db.effects_of(&last).await == 1 }).await;
    assert_eq!((stats.processed, stats.duplicates), B::COUNTED);
    assert_eq!(db.rows("effects").await, 2);
    assert_eq!(db.doubled_effects().await, 0);
    drop(consumer);
    db.cleanup().await;
}

macro_rules! over_tls {
    ($($test:ident: $broker:ty),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            consumed_over_tls_once_and_refused_with_another_ca::<$broker>(stringify!($test)).await
        }
    )*};
}

over_tls!(
    redis_streams_consumed_over_tls_once_and_refused_with_another_ca: Redis,
    mqtt_consumed_over_tls_once_and_refused_with_another_ca: Mosquitto,
    nats_consumed_over_tls_once_and_refused_with_another_ca: Nats,
    rabbitmq_consumed_over_tls_once_and_refused_with_another_ca: RabbitMq,
    kafka_consumed_over_tls_once_and_refused_with_another_ca: Kafka,
);

/// Leases on a Redis that speaks only TLS: `rediss://` checks the server against the
/// system's roots, which do not hold the test's CA; with the CA, a lease taken and completed
/// over TLS makes the next claim of its key find it done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_leases_over_tls_with_the_ca_and_refused_without() {
    use justonce_core::{Consumer, Fingerprint, Identity, LeaseClaim, Leases, Retention, Scope};
    use justonce_redis::{RedisLeases, TlsCertificates};
    let ca = TestCa::new();
    let broker = TlsBroker::start(Kind::Redis, &ca, false).expect("a Redis of the test's own");
    let url = broker.url();
    let refused = RedisLeases::connect(&url, Retention::default()).await.err();
    let refused = format!("{refused:?}");
    assert!(refused.contains("UnknownIssuer"), "{refused}");

    let certificates = TlsCertificates {
        client_tls: None,
        root_cert: Some(std::fs::read(ca.ca_file()).unwrap()),
    };
    let leases = RedisLeases::connect_tls(&url, certificates, Retention::default())
        .await
        .expect("leases over TLS with the CA");
    let identity = Identity::new(
        Scope::none(),
        Consumer::new("mailer").unwrap(),
        Key::new("welcome:u_1").unwrap(),
    );
    let fingerprint = Fingerprint::of("u_1");
    let hold = std::time::Duration::from_secs(30);
    let LeaseClaim::Acquired(lease) = leases
        .claim_lease(&identity, &fingerprint, hold)
        .await
        .unwrap()
    else {
        panic!("the first claim takes the lease");
    };
    leases.complete(&lease, b"sent").await.unwrap();
    assert_eq!(
        leases
            .claim_lease(&identity, &fingerprint, hold)
            .await
            .unwrap(),
        LeaseClaim::Done {
            result: Some(b"sent".to_vec())
        }
    );
}

/// A broker that requires a client certificate signed by the test's CA takes a consumer
/// that presents one, and refuses one that does not.
async fn consumed_with_a_client_certificate<B: Broker>(test: &str) {
    let ca = TestCa::new();
    let broker = TlsBroker::start(B::KIND, &ca, true).expect("a broker of the test's own");
    let url = broker.url();
    let db = TestDb::<Sqlite>::new(test).await;
    B::prepare(&broker, &ca, &name(&db)).await;
    let refused = B::connect(&url, &db, trusting(&ca)).await.err();
    assert!(
        matches!(
            refused,
            Some(Error::Tls(
                TlsError::ClientCertificateRequired | TlsError::ClientCertificateRefused(_)
            ))
        ),
        "{refused:?}"
    );
    let (cert, key) = ca.client("justonce");
    let tls = trusting(&ca)
        .with_client(std::fs::read(cert).unwrap(), std::fs::read(key).unwrap())
        .unwrap();
    let consumer = B::connect(&url, &db, tls.clone())
        .await
        .expect("connected with a client certificate");
    let publisher = B::publisher(&url, &name(&db), tls);
    assert_eq!(publish(&*publisher, "order:1").await, Delivered::Sent);
    let key = Key::new("order:1").unwrap();
    let stats = consume_until(&db, &consumer, || async { db.effects_of(&key).await == 1 }).await;
    assert_eq!(stats.processed, 1);
    drop(consumer);
    db.cleanup().await;
}

macro_rules! with_client_certificates {
    ($($test:ident: $broker:ty),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            consumed_with_a_client_certificate::<$broker>(stringify!($test)).await
        }
    )*};
}

with_client_certificates!(
    redis_streams_consumed_with_a_client_certificate: Redis,
    mqtt_consumed_with_a_client_certificate: Mosquitto,
    nats_consumed_with_a_client_certificate: Nats,
    kafka_consumed_with_a_client_certificate: Kafka,
);

/// A broker whose certificate names `localhost` only, reached as `127.0.0.1`: refused as a
/// certificate for another host.
async fn refused_when_the_certificate_names_another_host<B: Broker>(test: &str) {
    let ca = TestCa::new();
    let broker = TlsBroker::start_named(B::KIND, &ca, &["localhost"], false)
        .expect("a broker of the test's own");
    let db = TestDb::<Sqlite>::new(test).await;
    let refused = B::connect(&broker.url(), &db, trusting(&ca)).await.err();
    assert!(
        matches!(refused, Some(Error::Tls(TlsError::WrongHost))),
        "{refused:?}"
    );
    assert_eq!(
        refused.unwrap().to_string(),
        "TLS: the broker's certificate does not name the host of the URL"
    );
    db.cleanup().await;
}

macro_rules! for_another_host {
    ($($test:ident: $broker:ty),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            refused_when_the_certificate_names_another_host::<$broker>(stringify!($test)).await
        }
    )*};
}

for_another_host!(
    redis_streams_refused_when_the_certificate_names_another_host: Redis,
    mqtt_refused_when_the_certificate_names_another_host: Mosquitto,
    nats_refused_when_the_certificate_names_another_host: Nats,
    kafka_refused_when_the_certificate_names_another_host: Kafka,
);

/// A Kafka reader whose broker's certificate is replaced, while it runs, by one of a CA it
/// does not trust: its link names that cause, as its probe would at start, not "all
/// brokers are down".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_names_a_certificate_refused_while_it_runs() {
    let ca = TestCa::new();
    let broker = TlsBroker::start(Kind::Kafka, &ca, false).expect("a broker of the test's own");
    let url = broker.url();
    let db = TestDb::<Sqlite>::new("kafka_names_a_certificate_refused_while_it_runs").await;
    broker.create_kafka_topic(&ca, &name(&db)).await;
    let reader = Kafka::connect(&url, &db, trusting(&ca))
        .await
        .expect("connected with the right CA");
    let publisher = Kafka::publisher(&url, &name(&db), trusting(&ca));
    assert_eq!(publish(&*publisher, "order:1").await, Delivered::Sent);
    let key = Key::new("order:1").unwrap();
    let link = reader.link();
    let (another_ca, broker) = (TestCa::new(), std::sync::Mutex::new(broker));
    let replaced = std::sync::atomic::AtomicBool::new(false);
    consume_until(&db, &reader, || async {
        if db.effects_of(&key).await == 1 && !replaced.swap(true, Ordering::SeqCst) {
            let mut broker = broker.lock().unwrap();
            broker.replace_kafka_certificate(&another_ca).unwrap();
        }
        matches!(
            &*link.borrow(),
            Link::Reconnecting { error }
                if error == "TLS: the broker's certificate is not signed by a trusted CA"
        )
    })
    .await;
    drop(reader);
    db.cleanup().await;
}

/// A hosted Kafka's settings, TLS and a SCRAM login, against a broker that requires both.
/// An unknown user and a wrong password are refused, and the probe (what `check` and
/// `serve` run first) says that the login was refused, not that the broker did not answer.
/// With the right password, the consumer and the relay's publisher log in and each key
/// takes effect once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_takes_a_scram_login_over_tls_and_names_a_refused_one() {
    let ca = TestCa::new();
    let broker = TlsBroker::start_kafka_with_scram_user(&ca, "billing", "right-password")
        .expect("a broker of the test's own");
    let url = broker.url();
    let db = TestDb::<Sqlite>::new("kafka_takes_a_scram_login").await;
    let login = |user: &str, password: &str| Sasl::new(SaslMechanism::ScramSha512, user, password);
    for (user, password, reason) in [
        ("nobody", "right-password", "unknown-user"),
        ("billing", "wrong-password", "invalid-proof"),
    ] {
        let options = kafka_options(&db)
            .tls(trusting(&ca))
            .sasl(login(user, password));
        let refused = justonce_transport::kafka::probe(&url, &options).await;
        let Err(Error::Config(refusal)) = refused else {
            panic!("{user}: {refused:?}");
        };
        assert!(
            refusal.starts_with("the brokers refused the SASL login (")
                && refusal.contains(reason)
                && refusal.ends_with("): check the mechanism, the user and the password"),
            "{user}: {refusal}"
        );
    }

    broker.create_kafka_topic(&ca, &name(&db)).await;
    let right = login("billing", "right-password");
    let options = kafka_options(&db).tls(trusting(&ca)).sasl(right.clone());
    justonce_transport::kafka::probe(&url, &options)
        .await
        .expect("the right login");
    let consumer = KafkaReader::connect(&url, db.inbox.clone(), options).unwrap();
    let publisher = KafkaDestination::new(&url, &name(&db))
        .tls(trusting(&ca))
        .sasl(right);
    for key in ["order:0", "order:0", "order:1"] {
        assert_eq!(publish(&publisher, key).await, Delivered::Sent, "{key}");
    }
    let last = Key::new("order:1").unwrap();
    let stats = consume_until(&db, &consumer, || async { db.effects_of(&last).await == 1 }).await;
    assert_eq!((stats.processed, stats.duplicates), Kafka::COUNTED);
    assert_eq!(db.rows("effects").await, 2);
    drop(consumer);
    db.cleanup().await;
}
