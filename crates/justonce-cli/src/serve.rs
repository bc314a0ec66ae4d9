//! `justonce serve`: the public receiver, the admin listener and the relay, until SIGTERM.

use crate::admin_api;
use crate::config::{BrokerOptions, ConsumerSettings, Role, Settings};
use crate::console;
use crate::listener;
use crate::probes::{self, Consumers};
use crate::purge;
use anyhow::{Context, Result, ensure};
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use justonce_cli_support::Usage;
use justonce_cli_support::pacing::{self, Pacer};
use justonce_cli_support::shutdown_signal;
use justonce_http::receiver;
use justonce_sql::{Backend, Consumer, Inbox, Message, Outbox, RelayOptions, WorkFuture, trace};
use justonce_transport::amqp::AmqpConsumer;
use justonce_transport::kafka::KafkaReader;
use justonce_transport::mqtt::MqttConsumer;
use justonce_transport::nats::NatsConsumer;
use justonce_transport::redis_streams::RedisStreamConsumer;
use justonce_transport::{Broker, Error as BrokerError, Incoming, Link, Work};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tracing::Instrument;

/// A failpoint asked for that this build cannot reach would leave a fault test waiting for
/// a pause that never comes: `serve` refuses to start instead.
pub fn check_failpoint() -> Result<()> {
    let Ok(name) = std::env::var("JUSTONCE_FAILPOINT") else {
        return Ok(());
    };
    ensure!(
        cfg!(feature = "failpoints"),
        "JUSTONCE_FAILPOINT={name} is set, but this build has no failpoints: \
         build it with `--features failpoints`"
    );
    ensure!(
        name == receiver::FAILPOINT,
        "JUSTONCE_FAILPOINT={name}: serve has no such failpoint; it has {}",
        receiver::FAILPOINT
    );
    Ok(())
}

pub async fn serve<DB: Backend>(settings: Settings, inbox: Inbox<DB>) -> Result<()> {
    // Listened for before anything answers: a SIGTERM sent once the service is seen ready
    // stops it gracefully, whatever startup work is still being polled.
    let shutdown = shutdown_signal();
    let purge_plan = purge::Plan::of(&settings)?;
    let roles = settings.roles.clone();
    let mut sources = Vec::new();
    let source_names: Vec<String> = settings.sources.iter().map(|s| s.name.clone()).collect();
    let all_consumer_names: Vec<String> =
        settings.consumers.iter().map(|c| c.name.clone()).collect();
    // A process without the consumers role neither connects them nor waits for them to be
    // ready; its relay still delivers what they stored.
    let consumer_names: Vec<String> = if roles.runs(Role::Consumers) {
        settings.consumers.iter().map(|c| c.name.clone()).collect()
    } else {
        Vec::new()
    };
    let mut relay = inbox.outbox().relay().options(
        RelayOptions::default()
            .lease(settings.relay_lease)
            .per_destination(settings.relay_per_destination)
            .per_destination_total(settings.relay_per_destination_total)
            .concurrency(settings.relay_concurrency()),
    );
    // Each source's and consumer's keys, with how long they are kept: for the purge lag.
    let kept = purge_plan
        .kept()
        .map(|(name, retention)| {
            let keys = inbox.with_consumer(Consumer::new(name)?);
            Ok((name.to_owned(), retention.keep(), keys))
        })
        .collect::<Result<Vec<_>>>()?;
    for source in settings.sources {
        sources.push(source.source);
        relay = relay.destination_for(source.name, source.destination, source.deliver_for);
    }
    let mut consumers = Vec::new();
    for consumer in settings.consumers {
        let ConsumerSettings {
            name,
            from,
            options,
            tls_insecure,
            destination,
            deliver_for,
            tenant,
            ..
        } = consumer;
        if tls_insecure && roles.runs(Role::Consumers) {
            tracing::warn!(
                consumer = %name,
                "tls_verify = \"insecure\": the broker's certificate is not checked, and \
                 anyone on the path can read and change the messages"
            );
        }
        relay = relay.destination_for(name.clone(), destination, deliver_for);
        let mut inbox = inbox.with_consumer(Consumer::new(name.as_str())?);
        if let Some(tenant) = tenant {
            inbox = inbox.with_scope(tenant);
        }
        if roles.runs(Role::Consumers) {
            consumers.push((name, from, options, inbox));
        }
    }
    let consumer_states = Arc::new(Consumers::new(consumer_names.iter().map(String::as_str)));
    let probes = probes::router(&inbox, &consumer_states, &roles);
    let public = receiver::router(&inbox, sources, settings.body_limit).merge(probes.clone());
    let prometheus = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(receiver::ANSWERED_SECONDS.to_owned()),
            &ANSWER_BUCKETS,
        )
        .and_then(|builder| {
            builder.set_buckets_for_metric(
                Matcher::Full(justonce_sql::DELIVERED_SECONDS.to_owned()),
                &DELIVERY_BUCKETS,
            )
        })
        .and_then(PrometheusBuilder::install_recorder)
        .context("installing the metrics recorder")?;
    describe_metrics();
    for role in Role::ALL {
        let runs = if roles.runs(role) { 1.0 } else { 0.0 };
        metrics::gauge!(ROLE, "role" => role.name()).set(runs);
    }
    let outbox = inbox.outbox();
    let duplicates_outbox = outbox.clone();
    tokio::spawn(flush_duplicates(duplicates_outbox.clone()));
    let gauges = Arc::new(StoreGauges::default());
    tokio::spawn(refresh_store_gauges(outbox, kept, Arc::clone(&gauges)));
    let admin_token_set = settings.admin_token.is_some();
    let admin_access = Arc::new(admin_api::Access::new(
        settings.admin_token,
        settings.admin_listen,
    ));
    let console = console::router(&inbox, &consumer_states, &admin_access);
    let admin_api = admin_api::router(
        &inbox,
        &source_names,
        &all_consumer_names,
        &consumer_states,
        admin_access,
    );
    let admin = receiver::health_router(&inbox)
        .merge(probes)
        .merge(console)
        .merge(admin_api)
        .route(
            "/metrics",
            get(move || metrics_page(prometheus.clone(), Arc::clone(&gauges))),
        );

    let (stop, stopping) = watch::channel(false);
    let mut stopped_for_deadline = stopping.clone();
    let consumers_stopping = stopping.clone();
    let stopped = move || {
        let mut stopping = stopping.clone();
        async move {
            let _ = stopping.wait_for(|stop| *stop).await;
        }
    };
    // Without the receiver role the public listener is not opened: the admin listener
    // answers the probes.
    let public_listener = if roles.runs(Role::Receiver) {
        let bound = tokio::net::TcpListener::bind(settings.listen)
            .await
            .with_context(|| format!("listening on {}", settings.listen))?;
        Some(bound)
    } else {
        None
    };
    let admin_listener = tokio::net::TcpListener::bind(settings.admin_listen)
        .await
        .with_context(|| format!("listening on {}", settings.admin_listen))?;
    tracing::info!(
        listen = %public_listener.as_ref().map_or("-".to_owned(), |_| settings.listen.to_string()),
        admin = %settings.admin_listen,
        %roles,
        "serving"
    );
    if !admin_token_set && !settings.admin_listen.ip().is_loopback() {
        tracing::warn!(
            admin = %settings.admin_listen,
            "the admin listener is reachable from other machines and server.admin_token is \
             not set: anyone who reaches it can read the store through the admin API"
        );
    }
    let limits = settings.limits;
    let (public_connections, admin_connections) = listener::fit_open_files(&limits);
    let public = async {
        if let Some(public_listener) = public_listener {
            listener::serve(
                public_listener,
                public,
                limits,
                public_connections,
                true,
                stopped(),
            )
            .await;
        }
    };
    let admin = listener::serve(
        admin_listener,
        admin,
        limits,
        admin_connections,
        false,
        stopped(),
    );
    let relaying = async {
        if roles.runs(Role::Relay) {
            relay.run(stopped()).await
        } else {
            Ok(())
        }
    };
    let purging = async {
        if let Some(every) = settings.purge_every.filter(|_| roles.runs(Role::Purge)) {
            tokio::select! {
                () = purge_on_schedule(&purge_plan, &inbox, every) => {}
                () = stopped() => {}
            }
        }
    };
    // A consumer whose first connection fails its TLS handshake stops the service.
    let (misconfigured, mut misconfiguration) = tokio::sync::mpsc::channel(1);
    // Each consumer on a task of its own, so that consumers use every core. Dropped with
    // the set when the service stops.
    let mut consumer_tasks = tokio::task::JoinSet::new();
    for (name, from, options, inbox) in consumers {
        // The lines of the consumer, of its broker client and of each message carry its
        // name. At the error level, so that no filter that shows them leaves it out.
        let span = tracing::error_span!("consumer", consumer = %name);
        let consuming = consume(
            name,
            from,
            options,
            inbox,
            Arc::clone(&consumer_states),
            consumers_stopping.clone(),
            misconfigured.clone(),
        );
        consumer_tasks.spawn(consuming.instrument(span));
    }
    let consuming = async {
        while let Some(ended) = consumer_tasks.join_next().await {
            // A panic is a bug: it ends the service, as it did on the service's own task.
            if let Err(error) = ended
                && error.is_panic()
            {
                std::panic::resume_unwind(error.into_panic());
            }
        }
    };
    drop(misconfigured);
    let signal = async move {
        shutdown.await;
        tracing::info!("stopping: finishing requests in flight");
        let _ = stop.send(true);
    };
    let running = async {
        let ((), (), relayed, _, (), ()) =
            tokio::join!(public, admin, relaying, consuming, signal, purging);
        relayed.context("relay")
    };
    // Requests in flight get a bounded time to finish once stopping starts.
    let deadline = async {
        let _ = stopped_for_deadline.wait_for(|stop| *stop).await;
        tokio::time::sleep(limits.request_timeout + Duration::from_secs(5)).await;
    };
    let ended = tokio::select! {
        result = running => result,
        () = deadline => {
            tracing::warn!("requests still in flight after the drain time: stopping anyway");
            Ok(())
        }
        Some(usage) = misconfiguration.recv() => Err(usage.into()),
    };
    // The duplicates answered since the last flush are stored with the others.
    if let Err(error) = duplicates_outbox.flush_duplicates().await {
        tracing::warn!(%error, "the duplicates of the last second were not stored");
    }
    // A failure is reported as the command ends; a clean stop says so here.
    if ended.is_ok() {
        tracing::info!("stopped");
    }
    ended
}

/// 1 for each role this process runs, 0 for the others.
const ROLE: &str = "justonce_role";

/// Seconds from a webhook's arrival to its answer: a millisecond to half a minute (the
/// request timeout's default).
const ANSWER_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Seconds from a row's commit to its delivery: milliseconds when the target answers, up to
/// days while it is retried.
const DELIVERY_BUCKETS: [f64; 19] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
    3_600.0, 21_600.0, 86_400.0, 259_200.0,
];

/// Describes every metric the service exports, for the `# HELP` lines of `/metrics`.
fn describe_metrics() {
    justonce_sql::describe_metrics();
    justonce_http::describe_metrics();
    justonce_transport::describe_metrics();
    listener::describe_metrics();
    probes::describe_metrics();
    use metrics::describe_gauge;
    describe_gauge!(
        "justonce_purge_lag_seconds",
        "How long the oldest key of a consumer has been past its retention, by consumer"
    );
    describe_gauge!(
        "justonce_deliveries_due",
        "Outbox rows waiting to be delivered"
    );
    describe_gauge!("justonce_dead_letters", "Outbox rows dead-lettered");
    describe_gauge!(
        ROLE,
        "1 for each role this process runs (receiver, relay, consumers, purge), 0 for the others"
    );
    describe_gauge!(
        "justonce_oldest_due_age_seconds",
        "Age of the oldest outbox row waiting to be delivered"
    );
    describe_gauge!(
        "justonce_store_up",
        "1 when the last reads of the gauges from the database succeeded"
    );
    describe_gauge!(
        "justonce_store_gauges_age_seconds",
        "Seconds since the gauges read from the database were last read whole"
    );
}

/// Purges what is past its retention at start and then every `every`, paced as `justonce
/// purge` is by default so that claims keep their latency meanwhile. A failed purge is
/// logged and tried again at the next.
async fn purge_on_schedule<DB: Backend>(plan: &purge::Plan, inbox: &Inbox<DB>, every: Duration) {
    let mut schedule = tokio::time::interval(every);
    schedule.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        schedule.tick().await;
        let mut pacer = Pacer::new(pacing::DEFAULT_RATIO);
        match plan
            .run(inbox, purge::SERVICE_BATCH, &mut pacer, None)
            .await
        {
            Ok(purged) if purged.keys + purged.sent > 0 => tracing::info!(
                keys = purged.keys,
                sent_deliveries = purged.sent,
                "purged what is past its retention"
            ),
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, "purge failed: trying again at the next"),
        }
    }
}

/// Consumes one queue until `stopped` resolves: each message is claimed under the consumer
/// and written to the outbox for the consumer's target with the key `<consumer>:<id>`, in
/// one transaction, and acknowledged after the commit. A broker that cannot be reached at
/// the first connection is tried again every few seconds; a connection lost later, the
/// consumer makes again by itself. A TLS handshake or a login refused at the first
/// connection is a setting to fix: it is sent to `misconfigured`, and the service stops;
/// refused later (a broker that was down came back with another certificate), it is
/// retried.
async fn consume<DB: Backend>(
    name: String,
    from: String,
    options: BrokerOptions,
    inbox: Inbox<DB>,
    states: Arc<Consumers>,
    mut stopping: watch::Receiver<bool>,
    misconfigured: tokio::sync::mpsc::Sender<Usage>,
) {
    let mut first = true;
    loop {
        let work = forward_to_target(name.clone(), inbox.clone());
        let stopped = stopping.clone();
        let stopped = async move {
            let mut stopped = stopped;
            let _ = stopped.wait_for(|stop| *stop).await;
        };
        // A stop during a first connection attempt is seen once it ends; the drain
        // deadline bounds it.
        let link = |link: &Link| match link {
            Link::Connected => states.connected(&name),
            Link::Reconnecting { error } => states.failed(&name, error.clone()),
        };
        match consume_once(&from, &options, inbox.clone(), link, stopped, work).await {
            Ok(stats) if *stopping.borrow() => {
                tracing::info!(?stats, "stopped consuming");
                return;
            }
            // Consumers logs the change from consuming to not, once.
            Ok(_) => states.failed(&name, "the broker ended the consumer".to_owned()),
            Err(error @ (BrokerError::Tls(_) | BrokerError::Config(_))) => {
                let problem = match &error {
                    BrokerError::Tls(tls) => tls_problem(&name, tls),
                    error => format!("consumers.{name}: {error}"),
                };
                if first {
                    let _ = misconfigured.send(Usage(problem)).await;
                    return;
                }
                states.failed(&name, problem);
            }
            Err(error) => states.failed(&name, error.to_string()),
        }
        first = false;
        tokio::select! {
            _ = stopping.wait_for(|stop| *stop) => return,
            () = tokio::time::sleep(BROKER_RETRY) => {}
        }
    }
}

/// Connects once, and consumes until `stopped` resolves or the broker fails in a way that
/// connecting again does not mend, telling `link` of each change of the connection: the
/// consumer connects again by itself after a lost connection.
async fn consume_once<DB: Backend, E>(
    from: &str,
    options: &BrokerOptions,
    inbox: Inbox<DB>,
    link: impl Fn(&Link),
    stopped: impl std::future::Future,
    work: impl Work<DB, E>,
) -> Result<justonce_transport::ConsumerStats, BrokerError>
where
    E: std::error::Error + Send + Sync + 'static,
{
    match options {
        BrokerOptions::Amqp(options) => {
            let consumer = AmqpConsumer::connect(from, inbox, options.clone()).await?;
            run_consumer(consumer, link, stopped, work).await
        }
        BrokerOptions::Nats(options) => {
            let consumer = NatsConsumer::connect(from, inbox, options.clone()).await?;
            run_consumer(consumer, link, stopped, work).await
        }
        BrokerOptions::Mqtt(options) => {
            let consumer = MqttConsumer::connect(from, inbox, options.clone()).await?;
            run_consumer(consumer, link, stopped, work).await
        }
        BrokerOptions::Redis(options) => {
            let consumer = RedisStreamConsumer::connect(from, inbox, options.clone()).await?;
            run_consumer(consumer, link, stopped, work).await
        }
        // A group member keeps its partitions' offsets in the database, as a reader does.
        // Its client reaches the brokers only once it reads: connected once they answered
        // with the topic's metadata, through the consumer's TLS and SASL settings. Then its
        // link follows the client's own view of its brokers.
        BrokerOptions::Kafka(options) => {
            let reader = KafkaReader::connect(from, inbox, options.clone())?;
            justonce_transport::kafka::probe(from, options).await?;
            following(reader.link(), link, reader.run(stopped, work)).await
        }
    }
}

/// Runs the consumer until `stopped` resolves or the broker fails, telling `link` of its
/// connection, then closes it: the same for every broker.
async fn run_consumer<B: Broker, DB: Backend, E>(
    consumer: justonce_transport::Consumer<B, DB>,
    link: impl Fn(&Link),
    stopped: impl std::future::Future,
    work: impl Work<DB, E>,
) -> Result<justonce_transport::ConsumerStats, BrokerError>
where
    E: std::error::Error + Send + Sync + 'static,
{
    let ran = following(consumer.link(), link, consumer.run(stopped, work)).await;
    // Unacknowledged deliveries go back either way; a failed goodbye changes nothing.
    let _ = consumer.close().await;
    ran
}

/// Runs `run`, telling `report` the connection's state now and at each change.
async fn following<T>(
    mut link: watch::Receiver<Link>,
    report: impl Fn(&Link),
    run: impl std::future::Future<Output = T>,
) -> T {
    let mut run = std::pin::pin!(run);
    loop {
        let state = link.borrow_and_update().clone();
        report(&state);
        tokio::select! {
            ran = &mut run => return ran,
            changed = link.changed() => if changed.is_err() {
                return run.await;
            },
        }
    }
}

/// A refused TLS handshake in plain words, with the consumer and the setting to look at.
fn tls_problem(name: &str, tls: &justonce_transport::tls::TlsError) -> String {
    format!("consumers.{name}: {}", tls_advice(name, tls))
}

/// A refused TLS handshake of consumer `name` in plain words, with the setting to look at.
pub fn tls_advice(name: &str, tls: &justonce_transport::tls::TlsError) -> String {
    use justonce_transport::tls::TlsError;
    let setting = match tls {
        TlsError::UnknownIssuer => "tls_ca: the CA that signed the broker's certificate",
        TlsError::WrongHost => "from: the host the broker's certificate names",
        TlsError::ClientCertificateRequired | TlsError::ClientCertificateRefused(_) => {
            "tls_cert and tls_key: a client certificate the broker accepts"
        }
        TlsError::Handshake(_) => "from: the broker's TLS port",
        _ => "tls_ca, or the broker's certificate",
    };
    format!("cannot connect over TLS: {tls}; check consumers.{name}.{setting}")
}

/// How long a consumer waits before connecting again to a broker that failed.
const BROKER_RETRY: Duration = Duration::from_secs(5);

/// The work of a service consumer: one outbox row for the consumer's target, keyed
/// `<consumer>:<id>`, with the message's body and content type. A message with a tenant
/// (fixed by the inbox's scope, or named by the message) is keyed
/// `<consumer>:<tenant>:<id>`, stored in the tenant's scope, and sent with the tenant, as
/// a source's event is.
fn forward_to_target<DB: Backend>(
    name: String,
    inbox: Inbox<DB>,
) -> impl Work<DB, justonce_sql::Error> {
    move |tx: &mut justonce_sql::sqlx::Transaction<'_, DB>,
          message: &Incoming|
          -> WorkFuture<'_, (), justonce_sql::Error> {
        let name = name.clone();
        let inbox = inbox.with_scope(message.scope.clone());
        Box::pin(async move {
            let key = receiver::key_in_scope(&name, &message.scope, message.key.as_str())?;
            let tenant = message.scope.as_str();
            let mut row = Message::new(name.as_str(), message.body.clone());
            if !tenant.is_empty() {
                row = row.header(receiver::TENANT_HEADER, tenant);
            }
            if let Some(content_type) = &message.content_type {
                row = row.header("content-type", content_type.as_str());
            }
            // The delivery continues the message's trace: from this claim's span when it is
            // exported in that trace, else from the sender's context as it came.
            let sender = message.trace.clone();
            let context = match trace::context_to_send(&tracing::Span::current(), None) {
                Some(own)
                    if sender
                        .as_ref()
                        .is_none_or(|s| s.trace_id() == own.trace_id()) =>
                {
                    Some(own)
                }
                _ => sender,
            };
            if let Some(context) = &context {
                row = row.trace_context(context);
            }
            inbox.forward(tx, &key, row).await.map(drop)
        })
    }
}

/// How often the duplicates this process answered are added to the store's counts.
const DUPLICATES_FLUSH: Duration = Duration::from_secs(1);

/// Adds the duplicates this process answered to the store's per-minute counts every
/// `DUPLICATES_FLUSH`, for the console's dashboard; those a failed write kept wait for the
/// next.
async fn flush_duplicates<DB: Backend>(outbox: Outbox<DB>) {
    let mut schedule = tokio::time::interval(DUPLICATES_FLUSH);
    schedule.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        schedule.tick().await;
        if let Err(error) = outbox.flush_duplicates().await {
            tracing::debug!(%error, "storing the duplicates' counts failed: trying again");
        }
    }
}

/// When the gauges read from the database were last read whole.
#[derive(Default)]
struct StoreGauges {
    refreshed: Mutex<Option<Instant>>,
}

/// How often the gauges read from the database are read again.
const GAUGE_REFRESH: Duration = Duration::from_secs(5);

/// Reads the outbox's state and each consumer's purge lag (how long its oldest key has been
/// past its retention) every `GAUGE_REFRESH`, each read bounded by the probes' timeout, so
/// that a scrape answers from memory whatever the database does. `justonce_store_up` says
/// whether the last reads succeeded.
async fn refresh_store_gauges<DB: Backend>(
    outbox: Outbox<DB>,
    kept: Vec<(String, Duration, Inbox<DB>)>,
    gauges: Arc<StoreGauges>,
) {
    loop {
        let mut up = true;
        for (name, keep, keys) in &kept {
            match tokio::time::timeout(probes::STORE_TIMEOUT, keys.oldest_key_age()).await {
                Ok(Ok(age)) => {
                    metrics::gauge!("justonce_purge_lag_seconds", "consumer" => name.clone())
                        .set(age.saturating_sub(*keep).as_secs_f64())
                }
                _ => up = false,
            }
        }
        match tokio::time::timeout(probes::STORE_TIMEOUT, outbox.stats()).await {
            Ok(Ok(stats)) => {
                metrics::gauge!("justonce_deliveries_due").set(stats.due as f64);
                metrics::gauge!("justonce_dead_letters").set(stats.dead as f64);
                metrics::gauge!("justonce_oldest_due_age_seconds")
                    .set(stats.oldest_due.as_secs_f64());
            }
            _ => up = false,
        }
        metrics::gauge!("justonce_store_up").set(if up { 1.0 } else { 0.0 });
        if up {
            *gauges
                .refreshed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Instant::now());
        }
        tokio::time::sleep(GAUGE_REFRESH).await;
    }
}

/// Prometheus text, from memory: the counters the receiver and the relay keep, and the
/// gauges last read from the database with their age.
async fn metrics_page(prometheus: PrometheusHandle, gauges: Arc<StoreGauges>) -> Response {
    let refreshed = *gauges
        .refreshed
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(refreshed) = refreshed {
        metrics::gauge!("justonce_store_gauges_age_seconds").set(refreshed.elapsed().as_secs_f64());
    }
    (
        [(CONTENT_TYPE, "text/plain; version=0.0.4")],
        prometheus.render(),
    )
        .into_response()
}
