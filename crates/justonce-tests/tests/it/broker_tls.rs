//! Every broker over TLS, each a throwaway server of the test's own that speaks only TLS
//! with a certificate of the test's CA: with the right CA, messages the relay's publisher
//! sends over TLS are consumed over TLS and take effect once per key; with another CA, the
//! consumer and the publisher fail with a certificate error, not as a broker that is down.

use super::broker::{Consume, consume_until};
use justonce_sql::{Delivered, Delivery, Destination, Key};
use justonce_tests::servers::{Kind, TlsBroker};
use justonce_tests::tls::TestCa;
use justonce_tests::{TestDb, unique};
use justonce_transport::amqp::{AmqpConsumer, AmqpDestination, AmqpOptions};
use justonce_transport::mqtt::{MqttConsumer, MqttDestination, MqttOptions};
use justonce_transport::nats::{NatsConsumer, NatsDestination, NatsOptions};
use justonce_transport::redis_streams::{
    RedisStreamConsumer, RedisStreamDestination, RedisStreamOptions,
};
use justonce_transport::tls::{Tls, TlsError};
use justonce_transport::{ConsumerStats, Error};
use sqlx::Sqlite;

/// What the test does on one broker: its consumer and its publisher, with TLS settings.
trait Broker {
    type Consumer: Consume<Sqlite>;
    const KIND: Kind;
    /// What consuming `order:0`, `order:0`, `order:1` counts: a NATS stream drops the
    /// repeat of a `Nats-Msg-Id` itself.
    const COUNTED: (u64, u64) = (2, 1);

    async fn connect(url: &str, db: &TestDb<Sqlite>, tls: Tls) -> Result<Self::Consumer, Error>;
    fn publisher(url: &str, name: &str, tls: Tls) -> Box<dyn Destination>;
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
);
