//! Support for justonce's integration tests: a fresh set of tables per test on each real
//! database, and an effect table without a unique constraint, so that a doubled effect
//! shows as two rows.

mod amqp;
pub mod browser;
pub mod cluster;
mod consume;
pub mod cpu;
pub mod mariadb;
mod mqtt;
pub mod nats_cluster;
mod own_broker;
mod redis;
pub mod servers;
mod sink;
pub mod tls;

pub use amqp::{amqp_url, publish_keys, publish_many, try_publish_keys};
pub use consume::{acknowledge, consume};
pub use mqtt::{publish_while, publish_while_consuming};
pub use own_broker::{OwnBroker, Publishing, StoreFile, process_status};
pub use redis::{BreakableRedis, TestRedis, redis_url};
pub use sink::{Answer, Received, Script, Sink};

use justonce_sql::{Backend, Consumer, Inbox, InboxOptions, Key, Relay, WorkFuture};
use justonce_transport::Incoming;
use sqlx::{AssertSqlSafe, MySql, Postgres, Sqlite};
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

/// The MariaDB (or MySQL) server the tests use; they fail if it is down.
pub fn mysql_url() -> String {
    std::env::var("JUSTONCE_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// The NATS JetStream server the tests use; they fail if it is down.
pub fn nats_url() -> String {
    std::env::var("JUSTONCE_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// The Kafka-protocol broker the tests use (`scripts/test` starts nisshi there); they fail if
/// it is down.
pub fn kafka_url() -> String {
    std::env::var("JUSTONCE_TEST_KAFKA_URL")
        .unwrap_or_else(|_| "kafka://127.0.0.1:19092".to_owned())
}

/// The session timeout of the tests' Kafka group members: a member killed or paused is
/// replaced within seconds.
pub const KAFKA_SESSION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// Creates `topic`, of `partitions` partitions, on the Kafka broker at `url`.
pub async fn create_kafka_topic(url: &str, topic: &str, partitions: i32) {
    let mut config = rdkafka::ClientConfig::new();
    config.set("bootstrap.servers", url.trim_start_matches("kafka://"));
    create_kafka_topic_with(&config, topic, partitions).await
}

/// Creates `topic`, of `partitions` partitions, with the client settings `config`.
pub async fn create_kafka_topic_with(config: &rdkafka::ClientConfig, topic: &str, partitions: i32) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = config
        .create()
        .unwrap_or_else(|e| panic!("a Kafka admin client for {config:?}: {e}"));
    let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
    for created in (admin.create_topics([&new], &AdminOptions::new()).await)
        .unwrap_or_else(|e| panic!("Kafka at {config:?}: {e}"))
    {
        created.unwrap_or_else(|(topic, e)| panic!("creating {topic}: {e}"));
    }
}

/// The MQTT broker the tests use; they fail if it is down.
pub fn mqtt_url() -> String {
    std::env::var("JUSTONCE_TEST_MQTT_URL").unwrap_or_else(|_| "mqtt://127.0.0.1:1883".to_owned())
}

/// The MQTT settings the tests' consumers of `topic` share: one persistent session per
/// topic, kept for five minutes, so that a process that takes over a killed one's client id
/// receives what it left unacknowledged.
pub fn mqtt_options(topic: &str) -> justonce_transport::mqtt::MqttOptions {
    justonce_transport::mqtt::MqttOptions::new(topic, format!("{topic}-c"))
        .session_expiry(std::time::Duration::from_secs(300))
}

/// The settings of member `member` of the tests' shared subscription to `topic`: client
/// `<topic>-m<member>` in group `test`.
pub fn shared_mqtt_options(topic: &str, member: &str) -> justonce_transport::mqtt::MqttOptions {
    justonce_transport::mqtt::MqttOptions::new(topic, format!("{topic}-m{member}"))
        .shared("test")
        .session_expiry(std::time::Duration::from_secs(300))
}

/// The PostgreSQL server the tests use; they fail if it is down.
pub fn postgres_url() -> String {
    std::env::var("JUSTONCE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// The peak resident memory of `pid` in MiB, as the kernel counts it (`VmHWM`), or of this
/// process when `pid` is `None`.
pub fn peak_rss_mib(pid: Option<u32>) -> f64 {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/status"),
        None => "/proc/self/status".to_owned(),
    };
    let status = std::fs::read_to_string(path).expect("a Linux /proc");
    let kib: f64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .expect("VmHWM in /proc status");
    kib / 1024.0
}

/// The first transaction of the deliberately broken `separate-claim` workers: unless
/// consumer `test` already holds `key` in the tables under `prefix`, commits its effect on
/// its own, unclaimed. Returns whether it did; the claim follows in a second transaction,
/// so that only a kill in between doubles the effect.
pub async fn effect_unless_claimed<DB: TestBackend>(
    inbox: &Inbox<DB>,
    prefix: &str,
    key: &str,
) -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
    let claimed = format!(
        "SELECT count(*) FROM {prefix}keys WHERE scope = '' AND consumer = 'test' AND {} = '{key}'",
        DB::quoted("key")
    );
    if DB::count(inbox.pool(), claimed).await > 0 {
        return Ok(false);
    }
    let mut tx = inbox.begin().await?;
    DB::insert_effect(&mut tx, prefix, "test", key).await?;
    tx.commit().await?;
    Ok(true)
}

/// The exit code of a process that [`consumer_work`] ended on an `exit` key.
pub const EXITED: i32 = 86;

/// Whether [`consumer_work`] stops at its `hang` failpoint in this process.
static HANGS: AtomicBool = AtomicBool::new(false);

/// Makes [`consumer_work`] in this process stop at its `hang` failpoint, and end at its
/// `exit` one: for a worker process that a test kills or restarts there. A test's own consumer passes it, so that it can run
/// what the killed worker left, even on a reader, which cannot tell an entry read again.
pub fn hang_at_failpoints() {
    HANGS.store(true, Ordering::Relaxed);
}

/// The broker tests' work: one effect row for the message's key, failing for keys that start
/// with `fail` on attempts up to the digit after it (`fail2:` fails twice), and always
/// for keys that start with `bad`; it panics for keys that start with `panic`. A key that
/// starts with `hang`, on its first delivery in a process that asked for it
/// ([`hang_at_failpoints`]), prints `hanging <key>` and never finishes: a failpoint inside
/// an open transaction. A key that starts with `exit`, in such a process, ends it on every
/// delivery, as a work that runs out of memory would.
pub fn consumer_work<DB: TestBackend>(
    prefix: &str,
) -> impl for<'e, 't> Fn(
    &'t mut sqlx::Transaction<'e, DB>,
    &'t Incoming,
) -> WorkFuture<'t, (), sqlx::Error>
+ Sync
+ use<DB> {
    let prefix = prefix.to_owned();
    move |tx, message| {
        let prefix = prefix.clone();
        Box::pin(async move {
            refuse(message)?;
            let key = message.key.as_str();
            if key.starts_with("panic") {
                panic!("the test's work panics on {key}");
            }
            if key.starts_with("exit") && HANGS.load(Ordering::Relaxed) {
                std::process::exit(EXITED);
            }
            if key.starts_with("hang") && !message.redelivered && HANGS.load(Ordering::Relaxed) {
                use std::io::Write;
                let mut stdout = std::io::stdout();
                writeln!(stdout, "hanging {key}").and_then(|()| stdout.flush())?;
                std::future::pending::<()>().await;
            }
            DB::insert_effect(tx, &prefix, "test", key).await
        })
    }
}

/// The keys of each batch a [`batch_work`] was given, in order.
pub type SeenBatches = Arc<Mutex<Vec<Vec<String>>>>;

/// The broker tests' work for whole batches: notes the keys of each batch in `seen`, if
/// given, then writes one effect row per key with one multi-row INSERT. The whole batch
/// fails when [`consumer_work`] would fail one of its messages, and first waits
/// [`SLOW_WORK`] if a key starts with `slow`.
pub fn batch_work<DB: TestBackend>(
    prefix: &str,
    seen: Option<SeenBatches>,
) -> impl for<'e, 't> Fn(
    &'t mut sqlx::Transaction<'e, DB>,
    &'t [&'t Incoming],
) -> WorkFuture<'t, (), sqlx::Error>
+ Sync
+ use<DB> {
    let prefix = prefix.to_owned();
    move |tx, batch| {
        let keys: Vec<&str> = batch.iter().map(|message| message.key.as_str()).collect();
        if let Some(seen) = &seen {
            let noted = keys.iter().map(|&key| key.to_owned()).collect();
            seen.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(noted);
        }
        let refused = batch.iter().try_for_each(|message| refuse(message));
        let slow = keys.iter().any(|key| key.starts_with("slow"));
        let prefix = prefix.clone();
        Box::pin(async move {
            if slow {
                tokio::time::sleep(SLOW_WORK).await;
            }
            refused?;
            DB::insert_effects(tx, &prefix, "test", &keys).await
        })
    }
}

/// How long [`batch_work`] takes for a batch that holds a key starting with `slow`.
pub const SLOW_WORK: std::time::Duration = std::time::Duration::from_millis(300);

/// Why the tests' work refuses `message`: a key that starts with `fail` on attempts up to
/// the digit after it, and always one that starts with `bad`, after any `slow`.
fn refuse(message: &Incoming) -> Result<(), sqlx::Error> {
    let key = message.key.as_str();
    let key = key.strip_prefix("slow").unwrap_or(key);
    let failures = key
        .strip_prefix("fail")
        .and_then(|rest| rest.get(..1)?.parse::<u32>().ok())
        .unwrap_or(0);
    if key.starts_with("bad") || message.attempt <= failures {
        return Err(sqlx::Error::Protocol(format!(
            "refused on attempt {}",
            message.attempt
        )));
    }
    Ok(())
}

/// The databases a benchmark's `--backend` names.
pub const BACKENDS: [&str; 3] = ["postgres", "mysql", "sqlite"];

/// `harness-worker`'s failpoint, as `JUSTONCE_FAILPOINT` arms it and its pause announces
/// it: a key committed, its acknowledgement not yet sent.
pub const WORKER_FAILPOINT: &str = "committed-not-acknowledged";

/// The flags of the throughput benchmarks: `[--backend postgres|mysql|sqlite] [--messages N]
/// [--duplicates PERCENT] [--batch N] [--batches-at-once N] [--json]`, and `--broker NAME` where the benchmark
/// has brokers.
pub struct StreamArgs {
    /// `postgres`, `mysql` or `sqlite`.
    pub backend: String,
    /// The broker, one of those the benchmark offers (the first by default).
    pub broker: String,
    /// Messages in the stream.
    pub messages: usize,
    /// The share of them, in percent, that repeat an earlier key.
    pub duplicates: usize,
    /// Messages per batch.
    pub batch: usize,
    /// How many messages the broker sends ahead, if not the benchmark's own choice.
    pub prefetch: Option<usize>,
    /// How many batches a consumer runs at once.
    pub batches_at_once: usize,
    /// One JSON object per result instead of a table.
    pub json: bool,
}

impl StreamArgs {
    /// The flags of this process, over these defaults; `None` for a flag it does not know
    /// or a value out of range.
    pub fn from_args(messages: usize, batch: usize, brokers: &[&str]) -> Option<Self> {
        let mut args = Self {
            backend: "postgres".to_owned(),
            broker: brokers.first().copied().unwrap_or_default().to_owned(),
            messages,
            duplicates: 20,
            batch,
            prefetch: None,
            batches_at_once: 1,
            json: false,
        };
        let mut raw = std::env::args().skip(1);
        while let Some(flag) = raw.next() {
            match flag.as_str() {
                "--json" => args.json = true,
                "--backend" => {
                    args.backend = raw.next().filter(|b| BACKENDS.contains(&b.as_str()))?
                }
                "--messages" => args.messages = raw.next()?.parse().ok().filter(|n| *n > 0)?,
                "--duplicates" => {
                    args.duplicates = raw.next()?.parse().ok().filter(|p| *p < 100)?
                }
                "--batch" => args.batch = raw.next()?.parse().ok().filter(|n| *n > 0)?,
                "--prefetch" => args.prefetch = Some(raw.next()?.parse().ok().filter(|n| *n > 0)?),
                "--batches-at-once" => {
                    args.batches_at_once = raw.next()?.parse().ok().filter(|n| *n > 0)?
                }
                "--broker" => args.broker = raw.next().filter(|b| brokers.contains(&b.as_str()))?,
                _ => return None,
            }
        }
        Some(args)
    }

    /// How many distinct keys the stream holds.
    pub fn distinct(&self) -> usize {
        self.messages - self.messages * self.duplicates / 100
    }
}

/// A database the tests run against, with the statements they need on it.
pub trait TestBackend: Backend {
    /// A database URL no other test uses: a new file for SQLite, the shared server for
    /// PostgreSQL (tests there are kept apart by their table prefix).
    fn fresh_url(name: &str) -> String;

    /// Removes what [`TestBackend::fresh_url`] made, apart from tables.
    fn remove(url: &str);

    /// The URL of a new, empty database named `name`, for a test of a program that uses the
    /// default table names.
    fn create_database(name: &str) -> impl Future<Output = String> + Send;

    /// Removes a database [`TestBackend::create_database`] made.
    fn drop_database(url: &str) -> impl Future<Output = ()> + Send;

    /// The store's clock, the first parameter's milliseconds ago.
    const MILLIS_AGO: &'static str;

    /// How the first two parameters of a statement are written.
    const PARAMETERS: [&'static str; 2] = ["$1", "$2"];

    /// What follows a test table's columns in CREATE TABLE.
    const TABLE_OPTIONS: &'static str = "";

    /// `name` quoted as an identifier, for names that are reserved words (`key` on MySQL).
    fn quoted(name: &str) -> String {
        format!("\"{name}\"")
    }

    /// Moves a key's processing time `millis` into the past, by the store's clock.
    fn age_key<'a>(
        pool: &'a sqlx::Pool<Self>,
        prefix: &'a str,
        key: &'a str,
        millis: i64,
    ) -> impl Future<Output = ()> + Send + 'a;

    /// Moves the time `column` of every row of `table` that has one `millis` into the past.
    fn age_rows<'a>(
        pool: &'a sqlx::Pool<Self>,
        table: String,
        column: &'a str,
        millis: i64,
    ) -> impl Future<Output = ()> + Send + 'a;

    /// Writes one effect row for `key` in the caller's transaction.
    fn insert_effect<'a>(
        conn: &'a mut Self::Connection,
        prefix: &'a str,
        consumer: &'a str,
        key: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Writes an effect row for each of `keys` in the caller's transaction, with one
    /// multi-row INSERT.
    fn insert_effects<'a>(
        conn: &'a mut Self::Connection,
        prefix: &'a str,
        consumer: &'a str,
        keys: &'a [&'a str],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Runs one statement without arguments.
    fn execute<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: String,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// The single number a counting query returns.
    fn count<'a>(pool: &'a sqlx::Pool<Self>, sql: String) -> impl Future<Output = i64> + Send + 'a;

    /// [`TestBackend::count`] in the caller's transaction.
    fn count_in<'a>(
        conn: &'a mut Self::Connection,
        sql: String,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'a;

    /// The single text column a query returns, one value per row.
    fn texts<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: String,
    ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send + 'a;

    /// Each key of the effect table under `prefix` with its number of effect rows.
    fn effect_counts<'a>(
        pool: &'a sqlx::Pool<Self>,
        prefix: &'a str,
    ) -> impl Future<Output = Result<Vec<(String, i64)>, sqlx::Error>> + Send + 'a;
}

/// What every database runs the same way.
macro_rules! same_on_every_database {
    () => {
        async fn insert_effect<'a>(
            conn: &'a mut Self::Connection,
            prefix: &'a str,
            consumer: &'a str,
            key: &'a str,
        ) -> Result<(), sqlx::Error> {
            let [first, second] = Self::PARAMETERS;
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {prefix}effects (consumer, msg_key) VALUES ({first}, {second})"
            )))
            .bind(consumer)
            .bind(key)
            .execute(conn)
            .await
            .map(drop)
        }

        async fn insert_effects<'a>(
            conn: &'a mut Self::Connection,
            prefix: &'a str,
            consumer: &'a str,
            keys: &'a [&'a str],
        ) -> Result<(), sqlx::Error> {
            let mut insert = sqlx::QueryBuilder::<Self>::new(format!(
                "INSERT INTO {prefix}effects (consumer, msg_key) "
            ));
            insert.push_values(keys, |mut row, key| {
                row.push_bind(consumer).push_bind(*key);
            });
            insert.build().execute(conn).await.map(drop)
        }

        async fn age_key<'a>(
            pool: &'a sqlx::Pool<Self>,
            prefix: &'a str,
            key: &'a str,
            millis: i64,
        ) {
            let (ago, [_, second]) = (Self::MILLIS_AGO, Self::PARAMETERS);
            let column = Self::quoted("key");
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE {prefix}keys SET processed_at = {ago} WHERE {column} = {second}"
            )))
            .bind(millis)
            .bind(key)
            .execute(pool)
            .await
            .expect("age a key");
        }

        async fn age_rows<'a>(
            pool: &'a sqlx::Pool<Self>,
            table: String,
            column: &'a str,
            millis: i64,
        ) {
            let ago = Self::MILLIS_AGO;
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE {table} SET {column} = {ago} WHERE {column} IS NOT NULL"
            )))
            .bind(millis)
            .execute(pool)
            .await
            .expect("age rows");
        }

        async fn execute(pool: &sqlx::Pool<Self>, sql: String) -> Result<u64, sqlx::Error> {
            let done = sqlx::raw_sql(AssertSqlSafe(sql)).execute(pool).await?;
            Ok(done.rows_affected())
        }

        async fn count(pool: &sqlx::Pool<Self>, sql: String) -> i64 {
            let (count,): (i64,) = sqlx::query_as(AssertSqlSafe(sql.clone()))
                .fetch_one(pool)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
            count
        }

        async fn count_in(conn: &mut Self::Connection, sql: String) -> Result<i64, sqlx::Error> {
            let (count,): (i64,) = sqlx::query_as(AssertSqlSafe(sql)).fetch_one(conn).await?;
            Ok(count)
        }

        async fn texts(pool: &sqlx::Pool<Self>, sql: String) -> Result<Vec<String>, sqlx::Error> {
            sqlx::query_scalar(AssertSqlSafe(sql)).fetch_all(pool).await
        }

        async fn effect_counts(
            pool: &sqlx::Pool<Self>,
            prefix: &str,
        ) -> Result<Vec<(String, i64)>, sqlx::Error> {
            sqlx::query_as(AssertSqlSafe(format!(
                "SELECT msg_key, count(*) FROM {prefix}effects GROUP BY msg_key"
            )))
            .fetch_all(pool)
            .await
        }
    };
}

impl TestBackend for Sqlite {
    const MILLIS_AGO: &'static str = "CAST(unixepoch('subsec') * 1000 AS INTEGER) - $1";

    fn fresh_url(name: &str) -> String {
        let path = std::env::temp_dir().join(format!("justonce-{name}.db"));
        Self::remove(&format!("sqlite://{}", path.display()));
        format!("sqlite://{}", path.display())
    }

    fn remove(url: &str) {
        let path = PathBuf::from(url.trim_start_matches("sqlite://"));
        for suffix in ["", "-wal", "-shm"] {
            let mut file = path.clone().into_os_string();
            file.push(suffix);
            let _ = std::fs::remove_file(file);
        }
    }

    async fn create_database(name: &str) -> String {
        Self::fresh_url(name)
    }

    async fn drop_database(url: &str) {
        Self::remove(url)
    }

    same_on_every_database!();
}

impl TestBackend for Postgres {
    const MILLIS_AGO: &'static str = "now() - $1 * interval '1 millisecond'";

    fn fresh_url(_name: &str) -> String {
        postgres_url()
    }

    fn remove(_url: &str) {}

    async fn create_database(name: &str) -> String {
        on_server::<Self>(&postgres_url(), format!("CREATE DATABASE {name}")).await;
        database_url(&postgres_url(), name)
    }

    async fn drop_database(url: &str) {
        let (_, name) = url.rsplit_once('/').expect("a database URL");
        on_server::<Self>(
            &postgres_url(),
            format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        )
        .await;
    }

    same_on_every_database!();
}

impl TestBackend for MySql {
    const MILLIS_AGO: &'static str = "(UTC_TIMESTAMP(6) - INTERVAL (? * 1000) MICROSECOND)";
    const PARAMETERS: [&'static str; 2] = ["?", "?"];
    const TABLE_OPTIONS: &'static str = " DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin";

    fn quoted(name: &str) -> String {
        format!("`{name}`")
    }

    fn fresh_url(_name: &str) -> String {
        mysql_url()
    }

    fn remove(_url: &str) {}

    async fn create_database(name: &str) -> String {
        on_server::<Self>(&mysql_url(), format!("CREATE DATABASE {name}")).await;
        database_url(&mysql_url(), name)
    }

    async fn drop_database(url: &str) {
        let (_, name) = url.rsplit_once('/').expect("a database URL");
        on_server::<Self>(&mysql_url(), format!("DROP DATABASE IF EXISTS {name}")).await;
    }

    same_on_every_database!();
}

/// Runs one statement through a connection to `base`, such as creating a database.
async fn on_server<DB: TestBackend>(base: &str, sql: String) {
    let pool = sqlx::Pool::<DB>::connect(base)
        .await
        .unwrap_or_else(|e| panic!("cannot reach {base}: {e}"));
    DB::execute(&pool, sql.clone())
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    pool.close().await;
}

/// The URL of database `name` on the server of `base`.
fn database_url(base: &str, name: &str) -> String {
    let (server, _) = base.rsplit_once('/').expect("a database URL");
    format!("{server}/{name}")
}

/// Evaluates `$body` with `$db` naming the database of `$url`'s scheme: a child process's
/// way from the URL it was given to a generic function.
#[macro_export]
macro_rules! with_backend {
    ($url:expr, $db:ident => $body:expr) => {
        match $url.split(':').next() {
            Some("sqlite") => {
                type $db = sqlx::Sqlite;
                $body
            }
            Some("mysql" | "mariadb") => {
                type $db = sqlx::MySql;
                $body
            }
            _ => {
                type $db = sqlx::Postgres;
                $body
            }
        }
    };
}

/// A name no other test of any run uses: the process, a counter and the clock.
pub fn unique() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "{}_{}_{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// One test's own tables on one database.
pub struct TestDb<DB: TestBackend> {
    /// The database URL, for child processes.
    pub url: String,
    /// The table prefix no other test uses.
    pub prefix: String,
    /// An inbox for consumer `test`, migrated.
    pub inbox: Inbox<DB>,
}

impl<DB: TestBackend> TestDb<DB> {
    /// Fresh, migrated tables with an effect table beside them.
    pub async fn new(test: &str) -> Self {
        let unique = unique();
        Self::create(DB::fresh_url(&format!("{test}-{unique}")), &unique).await
    }

    /// Fresh, migrated tables with an effect table beside them, in the database of `url`.
    pub async fn at(url: &str) -> Self {
        Self::create(url.to_owned(), &unique()).await
    }

    async fn create(url: String, unique: &str) -> Self {
        let prefix = format!("t{unique}_");
        let inbox = Inbox::<DB>::connect_with(
            &url,
            Consumer::new("test").unwrap(),
            InboxOptions::default().prefix(&prefix),
        )
        .await
        .unwrap_or_else(|e| panic!("cannot reach {url}: {e}"));
        inbox.migrate().await.expect("migrate");
        DB::execute(
            inbox.pool(),
            format!(
                "CREATE TABLE {prefix}effects (consumer VARCHAR(255) NOT NULL, msg_key VARCHAR(255) NOT NULL){}",
                DB::TABLE_OPTIONS
            ),
        )
        .await
        .expect("create the effect table");
        Self { url, prefix, inbox }
    }

    /// The tables of a test whose pool was closed, through a new connection.
    pub async fn reopen(url: &str, prefix: &str) -> Self {
        let inbox = Inbox::<DB>::connect_with(
            url,
            Consumer::new("test").unwrap(),
            InboxOptions::default().prefix(prefix),
        )
        .await
        .unwrap_or_else(|e| panic!("cannot reach {url}: {e}"));
        Self {
            url: url.to_owned(),
            prefix: prefix.to_owned(),
            inbox,
        }
    }

    /// The inbox of another consumer on the same tables.
    pub fn consumer(&self, name: &str) -> Inbox<DB> {
        self.inbox.with_consumer(Consumer::new(name).unwrap())
    }

    /// Rows in one of this test's tables (`keys`, `outbox`, `effects`).
    pub async fn rows(&self, table: &str) -> i64 {
        DB::count(
            self.inbox.pool(),
            format!("SELECT count(*) FROM {}{table}", self.prefix),
        )
        .await
    }

    /// Effect rows written for `key`.
    pub async fn effects_of(&self, key: &Key) -> i64 {
        self.rows_of("effects", "msg_key", key).await
    }

    /// Counts of runs kept for `key`, in any scope and for any consumer.
    pub async fn runs_counted(&self, key: &Key) -> i64 {
        self.rows_of("runs", &DB::quoted("key"), key).await
    }

    /// Rows of this test's `table` whose `column` holds `key`.
    async fn rows_of(&self, table: &str, column: &str, key: &Key) -> i64 {
        let key = key.as_str().replace('\'', "''");
        let sql = format!(
            "SELECT count(*) FROM {}{table} WHERE {column} = '{key}'",
            self.prefix
        );
        DB::count(self.inbox.pool(), sql).await
    }

    /// Keys with more than one effect row: a doubled effect.
    pub async fn doubled_effects(&self) -> i64 {
        DB::count(
            self.inbox.pool(),
            format!(
                "SELECT count(*) FROM (SELECT msg_key FROM {}effects GROUP BY msg_key HAVING count(*) > 1) d",
                self.prefix
            ),
        )
        .await
    }

    /// Drops this test's tables, or its database file.
    pub async fn cleanup(self) {
        self.try_cleanup().await.expect("drop a test table");
    }

    /// Drops this test's tables, or its database file, and says if it could not.
    pub async fn try_cleanup(self) -> Result<(), sqlx::Error> {
        for table in [
            "effects",
            "outbox",
            "offsets",
            "breakers",
            "replays",
            "duplicates",
            "runs",
            "keys",
            "migrations",
        ] {
            DB::execute(
                self.inbox.pool(),
                format!("DROP TABLE IF EXISTS {}{table}", self.prefix),
            )
            .await?;
        }
        self.inbox.pool().close().await;
        DB::remove(&self.url);
        Ok(())
    }
}

/// A relay running in the background until [`RunningRelay::stop`].
pub struct RunningRelay {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), justonce_sql::Error>>,
}

impl RunningRelay {
    /// Starts `relay.run` on its own task.
    pub fn start<DB: Backend>(relay: Relay<DB>) -> Self {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            relay
                .run(async {
                    let _ = stopped.await;
                })
                .await
        });
        Self { stop, task }
    }

    /// Stops the relay after its round in flight, and fails if it failed.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.expect("the relay task").expect("the relay");
    }
}
