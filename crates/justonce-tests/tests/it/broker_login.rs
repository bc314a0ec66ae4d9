//! A login the broker refuses is a setting to fix, not a broker that is down: each broker's
//! probe (what `check` and `serve` run first) and its consumer say so, naming the refusal,
//! and `serve` stops at start. Each broker is a throwaway server of the test's own that
//! requires a login. Kafka's SASL login is in `broker_tls`.

use justonce_tests::{OwnBroker, TestDb};
use justonce_transport::Error;
use justonce_transport::amqp::{AmqpConsumer, AmqpOptions};
use justonce_transport::mqtt::{MqttConsumer, MqttOptions};
use justonce_transport::nats::{NatsConsumer, NatsOptions};
use justonce_transport::redis_streams::{RedisStreamConsumer, RedisStreamOptions};
use sqlx::Sqlite;

/// What the test does on one broker: its probe and its consumer's first connection.
trait Login {
    const KIND: &str;
    async fn probe(url: &str, name: &str) -> Result<(), Error>;
    async fn connect(url: &str, db: &TestDb<Sqlite>, name: &str) -> Result<(), Error>;
}

struct RabbitMq;
impl Login for RabbitMq {
    const KIND: &str = "amqp";
    async fn probe(url: &str, name: &str) -> Result<(), Error> {
        justonce_transport::amqp::probe(url, &AmqpOptions::new(name)).await
    }
    async fn connect(url: &str, db: &TestDb<Sqlite>, name: &str) -> Result<(), Error> {
        AmqpConsumer::connect(url, db.inbox.clone(), AmqpOptions::new(name))
            .await
            .map(drop)
    }
}

struct Nats;
impl Login for Nats {
    const KIND: &str = "nats";
    async fn probe(url: &str, name: &str) -> Result<(), Error> {
        justonce_transport::nats::probe(url, &NatsOptions::new(name, name)).await
    }
    async fn connect(url: &str, db: &TestDb<Sqlite>, name: &str) -> Result<(), Error> {
        NatsConsumer::connect(url, db.inbox.clone(), NatsOptions::new(name, name))
            .await
            .map(drop)
    }
}

struct Redis;
impl Login for Redis {
    const KIND: &str = "redis";
    async fn probe(url: &str, name: &str) -> Result<(), Error> {
        let options = RedisStreamOptions::new(name, "test");
        justonce_transport::redis_streams::probe(url, &options).await
    }
    async fn connect(url: &str, db: &TestDb<Sqlite>, name: &str) -> Result<(), Error> {
        let options = RedisStreamOptions::new(name, "test");
        RedisStreamConsumer::connect(url, db.inbox.clone(), options)
            .await
            .map(drop)
    }
}

struct Mosquitto;
impl Login for Mosquitto {
    const KIND: &str = "mqtt";
    async fn probe(url: &str, name: &str) -> Result<(), Error> {
        let options = MqttOptions::new(name, format!("{name}-c"));
        justonce_transport::mqtt::probe(url, &options).await
    }
    async fn connect(url: &str, db: &TestDb<Sqlite>, name: &str) -> Result<(), Error> {
        let options = MqttOptions::new(name, format!("{name}-c"));
        MqttConsumer::connect(url, db.inbox.clone(), options)
            .await
            .map(drop)
    }
}

async fn a_refused_login_is_named_as_a_setting<B: Login>(test: &str) {
    let broker = OwnBroker::start_with_login(B::KIND)
        .await
        .expect("a broker of the test's own");
    let db = TestDb::<Sqlite>::new(test).await;
    let name = format!("{}orders", db.prefix);
    let wrong = broker.url_with_password("wrong-password");
    let refusals = [
        B::probe(&wrong, &name).await,
        B::connect(&wrong, &db, &name).await,
    ];
    for refused in refusals {
        let Err(Error::Config(reason)) = refused else {
            panic!("{refused:?}");
        };
        assert!(
            reason.starts_with("the broker refused access (")
                && reason.ends_with(
                    "): check the user and the password in the URL, and what the user may do"
                ),
            "{reason}"
        );
    }
    B::probe(&broker.url(), &name)
        .await
        .expect("the right login");
    B::connect(&broker.url(), &db, &name)
        .await
        .expect("the right login");
    db.cleanup().await;
}

macro_rules! refused_logins {
    ($($test:ident: $broker:ty),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            a_refused_login_is_named_as_a_setting::<$broker>(stringify!($test)).await
        }
    )*};
}

refused_logins!(
    rabbitmq_names_a_refused_login_as_a_setting: RabbitMq,
    nats_names_a_refused_login_as_a_setting: Nats,
    redis_streams_names_a_refused_login_as_a_setting: Redis,
    mqtt_names_a_refused_login_as_a_setting: Mosquitto,
);
