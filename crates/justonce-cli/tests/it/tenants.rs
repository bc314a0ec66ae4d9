//! Tenants of a source or consumer: named by a header from a list, or fixed by the
//! configuration; each event claimed, stored and delivered in its tenant's scope.

use crate::serve::{
    Server, all_delivered, client, database, drop_database, post, redis_orders, run_capturing,
    signature, stats_json, text_of,
};
use justonce_tests::{Answer, Sink, TestBackend};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

on_every_database!(
    the_same_event_id_from_two_tenants_is_two_events,
    a_consumer_with_a_tenant_stores_and_delivers_in_its_scope,
    a_consumer_takes_each_message_s_tenant_from_the_message,
    the_secret_that_verifies_names_the_tenant,
    one_tenants_backlog_at_a_hanging_target_does_not_delay_another,
);

/// `demo` takes its tenant from `X-Tenant`, acme or globex; `fixed` stores every event for
/// initech.
const TENANTS: &str = r#"tenant = "header:X-Tenant"
tenants = ["acme", "globex"]

[sources.fixed]
scheme = "hmac-sha256"
secrets = ["env:DEMO_SECRET"]
id = "json:/id"
tenant = "initech"
target = "TARGET"
"#;

/// Posts `body` to `source` with `tenant` in `X-Tenant` if given; the status and answer.
async fn post_for(
    public: &str,
    source: &str,
    tenant: Option<&str>,
    body: &str,
    signed: bool,
) -> (u16, serde_json::Value) {
    let signature = signed.then(|| signature(body));
    post_with(public, source, tenant, body, signature).await
}

/// Posts `body` to `source` with `signature` in `X-Signature` and `tenant` in `X-Tenant`,
/// each if given; the status and answer.
async fn post_with(
    public: &str,
    source: &str,
    tenant: Option<&str>,
    body: &str,
    signature: Option<String>,
) -> (u16, serde_json::Value) {
    let mut request = client()
        .post(format!("{public}/webhooks/{source}"))
        .header("content-type", "application/json")
        .body(body.to_owned())
        .timeout(Duration::from_secs(10));
    if let Some(signature) = signature {
        request = request.header("x-signature", signature);
    }
    if let Some(tenant) = tenant {
        request = request.header("x-tenant", tenant);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    let answer = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (status, answer)
}

async fn the_same_event_id_from_two_tenants_is_two_events<DB: TestBackend>(test: &str) {
    let (db, url) = database::<DB>(test).await;
    let sink = Sink::start().await;
    let more = TENANTS.replace("TARGET", &sink.url());
    let mut server = Server::configure_with(&url, &sink.url(), &more);
    server.start().await;
    let public = server.public.clone();
    let body = r#"{"id":"evt_1"}"#;

    for (tenant, status) in [
        ("acme", "accepted"),
        ("globex", "accepted"),
        ("acme", "duplicate"),
    ] {
        let (code, answer) = post_for(&public, "demo", Some(tenant), body, true).await;
        assert_eq!(code, 200, "{answer}");
        assert_eq!(answer["status"], status);
        assert_eq!(answer["key"], format!("demo:{tenant}:evt_1"));
    }
    // A tenant off the list, none at all, or an unsigned request: refused, nothing stored.
    let (code, problem) = post_for(&public, "demo", Some("umbrella"), body, true).await;
    assert_eq!(code, 403, "{problem}");
    assert_eq!(problem["title"], "tenant not allowed");
    let (code, problem) = post_for(&public, "demo", None, body, true).await;
    assert_eq!(code, 400, "{problem}");
    assert_eq!(problem["title"], "no tenant");
    assert!(
        problem["detail"].as_str().unwrap().contains("x-tenant"),
        "{problem}"
    );
    let (code, _) = post_for(&public, "demo", Some("umbrella"), body, false).await;
    assert_eq!(code, 401);
    // A fixed tenant needs nothing from the sender, and ignores what it says.
    let (code, answer) = post_for(&public, "fixed", Some("acme"), body, true).await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!(answer["key"], "fixed:initech:evt_1");

    // Three deliveries, each with its own key and its tenant.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while sink.requests() < 3 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let delivered: BTreeSet<(String, String)> = sink
        .received()
        .into_iter()
        .map(|request| {
            assert_eq!(request.body, body.as_bytes());
            let tenant = request.headers.get("justonce-tenant").cloned();
            (request.key.unwrap(), tenant.unwrap_or_default())
        })
        .collect();
    let expected = [
        ("demo:acme:evt_1", "acme"),
        ("demo:globex:evt_1", "globex"),
        ("fixed:initech:evt_1", "initech"),
    ]
    .map(|(key, tenant)| (key.to_owned(), tenant.to_owned()));
    assert_eq!(delivered, BTreeSet::from(expected.clone()));
    all_delivered(&server, 3).await;
    assert_eq!(sink.requests(), 3, "a delivery was sent twice");

    // The store holds one key and one event per tenant, each in its scope.
    let stats = stats_json(&server).await;
    let keys: BTreeSet<(String, String, u64)> = stats["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|count| {
            (
                count["consumer"].as_str().unwrap().to_owned(),
                count["scope"].as_str().unwrap_or_default().to_owned(),
                count["keys"].as_u64().unwrap(),
            )
        })
        .collect();
    let expected_keys = [("demo", "acme"), ("demo", "globex"), ("fixed", "initech")]
        .map(|(consumer, scope)| (consumer.to_owned(), scope.to_owned(), 1));
    assert_eq!(keys, BTreeSet::from(expected_keys), "{stats}");
    let (events, listed) = listed_events(&server).await;
    let events: BTreeSet<(String, String)> = events.into_iter().collect();
    assert_eq!(events, BTreeSet::from(expected), "{listed}");

    // The tenant is a label of the receiver's counts: only ever a listed one, or empty
    // for a request refused before its tenant was known.
    let metrics = text_of(&client(), &format!("{}/metrics", server.admin)).await;
    let count = |labels: &[&str]| -> f64 {
        metrics
            .lines()
            .filter(|line| line.starts_with("justonce_webhooks_total{"))
            .filter(|line| labels.iter().all(|label| line.contains(label)))
            .map(|line| line.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum()
    };
    assert_eq!(
        count(&["source=\"demo\"", "tenant=\"acme\"", "outcome=\"accepted\""]),
        1.0,
        "{metrics}"
    );
    assert_eq!(
        count(&["tenant=\"acme\"", "outcome=\"duplicate\""]),
        1.0,
        "{metrics}"
    );
    assert_eq!(
        count(&["tenant=\"\"", "outcome=\"rejected_tenant\""]),
        2.0,
        "{metrics}"
    );
    assert!(!metrics.contains("umbrella"), "{metrics}");

    server.stop().await;
    drop_database(db, &url).await;
}

/// A consumer with a fixed tenant: its messages are claimed in the tenant's scope, keyed
/// `<consumer>:<tenant>:<id>` and delivered with the tenant.
async fn a_consumer_with_a_tenant_stores_and_delivers_in_its_scope<DB: TestBackend>(test: &str) {
    use redis::AsyncCommands;
    let (db, url) = database::<DB>(test).await;
    let sink = Sink::start().await;
    let redis_url = justonce_tests::redis_url();
    let stream = format!("{}tenant_orders", db.prefix);
    let mut redis = redis_orders(&stream).await;
    let consumer = format!(
        "[consumers.orders]\nfrom = \"{redis_url}\"\nstream = \"{stream}\"\n\
         id = \"header:order_id\"\ntenant = \"initech\"\ntarget = \"{}\"\n",
        sink.url()
    );
    let mut server = Server::configure_with(&url, &sink.url(), &consumer);
    server.start().await;
    // Every entry read and settled, the repeated one too, and two deliveries sent.
    settled(&mut redis, &stream, 3, &sink, 2).await;
    // Stopped and its stream deleted before anything is asserted: a failure leaves
    // nothing on the shared Redis.
    server.stop().await;
    let _: () = redis.del(&stream).await.unwrap();
    let delivered: Vec<(String, String)> = sink
        .received()
        .into_iter()
        .map(|request| {
            let tenant = request.headers.get("justonce-tenant").cloned();
            (request.key.unwrap(), tenant.unwrap_or_default())
        })
        .collect();
    let delivered = BTreeSet::from_iter(delivered.iter().cloned());
    let expected = ["orders:initech:order-1", "orders:initech:order-2"]
        .map(|key| (key.to_owned(), "initech".to_owned()));
    assert_eq!(delivered, BTreeSet::from(expected));
    assert_eq!(sink.requests(), 2, "a message was delivered twice");
    let stats = stats_json(&server).await;
    let orders: Vec<&serde_json::Value> = stats["keys"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|count| count["consumer"] == "orders")
        .collect();
    assert_eq!(
        orders,
        [
            &serde_json::json!({"consumer": "orders", "scope": "initech", "keys": 2, "in_progress": 0})
        ],
        "{stats}"
    );
    drop_database(db, &url).await;
}

/// A consumer that reads each message's tenant from a field: the same order id from two
/// tenants is two effects, each row in its tenant's scope; a message with no tenant, a
/// blank one or one off the list is dead-lettered at once, with a reason that says which.
async fn a_consumer_takes_each_message_s_tenant_from_the_message<DB: TestBackend>(test: &str) {
    use redis::AsyncCommands;
    let (db, url) = database::<DB>(test).await;
    let sink = Sink::start().await;
    let redis_url = justonce_tests::redis_url();
    let stream = format!("{}tenant_fields", db.prefix);
    let dead = format!("{stream}.dead");
    let mut redis = redis::Client::open(redis_url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("Redis");
    let _: () = redis.del(&[&stream, &dead]).await.unwrap();
    let entries: [(&str, Option<&str>); 6] = [
        ("order-1", Some("acme")),
        ("order-1", Some("globex")),
        ("order-1", Some("acme")),
        ("order-2", Some("umbrella\nforged line")),
        ("order-3", None),
        ("order-4", Some("  ")),
    ];
    for (id, tenant) in entries {
        let body = format!(r#"{{"order":"{id}"}}"#);
        let mut fields = vec![("order_id", id), ("body", body.as_str())];
        fields.extend(tenant.map(|tenant| ("tenant", tenant)));
        let _: String = redis.xadd(&stream, "*", &fields).await.unwrap();
    }
    let consumer = format!(
        "[consumers.orders]\nfrom = \"{redis_url}\"\nstream = \"{stream}\"\n\
         id = \"header:order_id\"\ntenant = \"header:tenant\"\n\
         tenants = [\"acme\", \"globex\"]\ntarget = \"{}\"\n",
        sink.url()
    );
    let mut server = Server::configure_with(&url, &sink.url(), &consumer);
    server.start().await;
    settled(&mut redis, &stream, 6, &sink, 2).await;
    let metrics = text_of(&client(), &format!("{}/metrics", server.admin)).await;
    let stats = stats_json(&server).await;
    server.stop().await;
    let dead_letters: redis::streams::StreamRangeReply = redis.xrange_all(&dead).await.unwrap();
    let _: () = redis.del(&[&stream, &dead]).await.unwrap();

    let delivered: BTreeSet<(String, String)> = sink
        .received()
        .into_iter()
        .map(|request| {
            let tenant = request.headers.get("justonce-tenant").cloned();
            (request.key.unwrap(), tenant.unwrap_or_default())
        })
        .collect();
    let expected = [
        ("orders:acme:order-1", "acme"),
        ("orders:globex:order-1", "globex"),
    ]
    .map(|(key, tenant)| (key.to_owned(), tenant.to_owned()));
    assert_eq!(delivered, BTreeSet::from(expected));
    assert_eq!(sink.requests(), 2, "a message was delivered twice");
    let orders: BTreeSet<(String, u64)> = stats["keys"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|count| count["consumer"] == "orders")
        .map(|count| {
            (
                count["scope"].as_str().unwrap().to_owned(),
                count["keys"].as_u64().unwrap(),
            )
        })
        .collect();
    let expected = [("acme".to_owned(), 1), ("globex".to_owned(), 1)];
    assert_eq!(orders, BTreeSet::from(expected), "{stats}");

    // Each refused message dead-lettered once, on its first attempt, saying why.
    let reasons: Vec<(String, String)> = dead_letters
        .ids
        .iter()
        .map(|entry| {
            let field = |name: &str| -> String {
                entry
                    .get::<String>(name)
                    .unwrap_or_else(|| panic!("{name} in {entry:?}"))
            };
            (field("order_id"), field("x-justonce-reason"))
        })
        .collect();
    let [(two, not_allowed), (three, missing), (four, blank)] = reasons.as_slice() else {
        panic!("three dead letters: {reasons:?}");
    };
    assert_eq!([two, three, four], ["order-2", "order-3", "order-4"]);
    assert_eq!(
        not_allowed,
        r#"tenant not allowed: "umbrella\nforged line" is not one of the tenants this consumer takes"#
    );
    assert!(missing.starts_with("no tenant: "), "{missing}");
    assert!(missing.contains("tenant"), "{missing}");
    assert_eq!(blank, "no tenant: the tenant is blank");
    let rejected: f64 = metrics
        .lines()
        .filter(|line| line.starts_with("justonce_deliveries_rejected_tenant_total{"))
        .filter(|line| line.contains("consumer=\"orders\""))
        .map(|line| line.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert_eq!(rejected, 3.0, "{metrics}");
    drop_database(db, &url).await;
}

/// Two tenants of `signed` and `named`, each signing with its own secret; `named` also takes
/// the tenant from `X-Tenant`, which must be the secret's.
const BY_SECRET: &str = r#"
[sources.signed]
scheme = "hmac-sha256"
id = "json:/id"
target = "TARGET"

[sources.signed.tenant_secrets]
acme = ["env:ACME_SECRET"]
globex = ["env:GLOBEX_OLD_SECRET", "env:GLOBEX_SECRET"]

[sources.named]
scheme = "hmac-sha256"
id = "json:/id"
tenant = "header:X-Tenant"
target = "TARGET"

[sources.named.tenant_secrets]
acme = ["env:ACME_SECRET"]
globex = ["env:GLOBEX_SECRET"]
"#;

const ACME_SECRET: &str = "acme's own signing secret";
const GLOBEX_SECRET: &str = "globex's own signing secret";

/// Posts `body` to `source`, signed with `secret`, with `tenant` in `X-Tenant` if given;
/// the status and answer.
async fn post_signed_by(
    public: &str,
    source: &str,
    secret: &str,
    tenant: Option<&str>,
    body: &str,
) -> (u16, serde_json::Value) {
    use hmac::Mac;
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(body.as_bytes());
    let hex: String = (mac.finalize().into_bytes().iter())
        .map(|b| format!("{b:02x}"))
        .collect();
    post_with(public, source, tenant, body, Some(format!("sha256={hex}"))).await
}

/// The tenant of an event is the one whose secret verifies it: the same event id signed by
/// two tenants is two events. Signed by one tenant and naming another: 403, nothing stored.
async fn the_secret_that_verifies_names_the_tenant<DB: TestBackend>(test: &str) {
    let (db, url) = database::<DB>(test).await;
    let sink = Sink::start().await;
    let more = BY_SECRET.replace("TARGET", &sink.url());
    let mut server = Server::configure_with(&url, &sink.url(), &more);
    let env = [
        ("ACME_SECRET", ACME_SECRET),
        ("GLOBEX_SECRET", GLOBEX_SECRET),
        ("GLOBEX_OLD_SECRET", "globex's signing secret of last year"),
        ("RUST_LOG", "warn"),
    ];
    let _logs = server.start_logged(&[], &env).await;
    let public = server.public.clone();
    let body = r#"{"id":"evt_1"}"#;

    for (secret, tenant, status) in [
        (ACME_SECRET, "acme", "accepted"),
        (GLOBEX_SECRET, "globex", "accepted"),
        (ACME_SECRET, "acme", "duplicate"),
    ] {
        let (code, answer) = post_signed_by(&public, "signed", secret, None, body).await;
        assert_eq!(code, 200, "{answer}");
        assert_eq!(answer["status"], status);
        assert_eq!(answer["key"], format!("signed:{tenant}:evt_1"));
    }
    // Naming a tenant changes nothing where the secret alone names it.
    let (code, answer) = post_signed_by(&public, "signed", ACME_SECRET, Some("globex"), body).await;
    assert_eq!((code, &answer["key"]), (200, &"signed:acme:evt_1".into()));
    // No tenant's secret: 401, as for any source.
    let (code, _) = post_signed_by(&public, "signed", crate::serve::SECRET, None, body).await;
    assert_eq!(code, 401);

    // Signed with acme's secret, claiming globex: refused, never stored.
    let (code, problem) = post_signed_by(&public, "named", ACME_SECRET, Some("globex"), body).await;
    assert_eq!(code, 403, "{problem}");
    assert_eq!(problem["title"], "tenant not allowed");
    let (code, problem) = post_signed_by(&public, "named", ACME_SECRET, None, body).await;
    assert_eq!(code, 400, "{problem}");
    assert_eq!(problem["title"], "no tenant");
    let (code, answer) =
        post_signed_by(&public, "named", GLOBEX_SECRET, Some("globex"), body).await;
    assert_eq!((code, &answer["key"]), (200, &"named:globex:evt_1".into()));

    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while sink.requests() < 3 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    all_delivered(&server, 3).await;
    let delivered: BTreeSet<(String, String)> = sink
        .received()
        .into_iter()
        .map(|request| {
            let tenant = request.headers.get("justonce-tenant").cloned();
            (request.key.unwrap(), tenant.unwrap_or_default())
        })
        .collect();
    let expected = [
        ("named:globex:evt_1", "globex"),
        ("signed:acme:evt_1", "acme"),
        ("signed:globex:evt_1", "globex"),
    ]
    .map(|(key, tenant)| (key.to_owned(), tenant.to_owned()));
    assert_eq!(delivered, BTreeSet::from(expected));
    assert_eq!(sink.requests(), 3, "a delivery was sent twice");
    // Each event stored once, in its tenant's scope (the admin API: the commands would
    // need the tenants' secrets in their environment too).
    let (events, listed) = listed_events(&server).await;
    assert_eq!(events.len(), 3, "{listed}");
    assert_eq!(BTreeSet::from_iter(events), delivered, "{listed}");
    server.stop().await;
    drop_database(db, &url).await;
}

/// A source that stored keys under no tenant, then given a tenant: `justonce check` warns
/// that those keys are in a scope the configuration no longer gives it.
#[tokio::test]
async fn check_warns_of_keys_in_a_scope_the_configuration_no_longer_gives() {
    let (db, url) = database::<justonce_sql::sqlx::Sqlite>("check-scopes").await;
    let sink = Sink::start().await;
    let mut server = Server::configure(&url, &sink.url());
    server.start().await;
    let (code, _) = post(&client(), &server.public, r#"{"id":"evt_1"}"#)
        .await
        .unwrap();
    assert_eq!(code, 200);
    let (code, _, stderr) = run_capturing(&server, &["check"]).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(!stderr.contains("warning"), "{stderr}");
    server.stop().await;

    let tenanted = Server::configure_with(&url, &sink.url(), "tenant = \"acme\"\n");
    let (code, stdout, stderr) = run_capturing(&tenanted, &["check"]).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("configuration and database are fine"),
        "{stdout}"
    );
    assert!(
        stderr.contains(
            "warning: demo holds 1 key under no tenant, which its configuration no longer \
             gives it (it gives tenant acme): a message claimed there and sent again is \
             claimed anew and acts again, until those keys are purged"
        ),
        "{stderr}"
    );
    drop_database(db, &url).await;
}

/// When `sink` first received the request keyed `key`, waiting up to `within` from `since`.
async fn arrival(sink: &Sink, key: &str, since: Instant, within: Duration) -> Option<Duration> {
    loop {
        let received = sink.received();
        if let Some(request) = received.iter().find(|r| r.key.as_deref() == Some(key)) {
            return Some(request.at.saturating_duration_since(since));
        }
        if since.elapsed() > within {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The target hangs on every delivery of acme past the source's 3 s timeout. With 40 of
/// acme's events stuck there, globex's event arrives within 2 s; and again while acme's
/// breaker holds acme's deliveries back, which `stats` lists for acme alone.
async fn one_tenants_backlog_at_a_hanging_target_does_not_delay_another<DB: TestBackend>(
    test: &str,
) {
    let (db, url) = database::<DB>(test).await;
    let sink = Sink::scripted(Arc::new(|key, _| {
        let mut answer = Answer::status(200);
        if key.starts_with("demo:acme:") {
            answer.delay = Duration::from_secs(60);
        }
        answer
    }))
    .await;
    let more = "timeout = \"3s\"\ntenant = \"header:X-Tenant\"\ntenants = [\"acme\", \"globex\"]\n";
    let mut server = Server::configure_with(&url, &sink.url(), more);
    server.start().await;
    let public = server.public.clone();
    for n in 0..40 {
        let body = format!(r#"{{"id":"evt_{n}"}}"#);
        let (code, answer) = post_for(&public, "demo", Some("acme"), &body, true).await;
        assert_eq!(code, 200, "{answer}");
    }
    // The relay has filled acme's lane by now.
    let deadline = Instant::now() + Duration::from_secs(10);
    while sink.requests() < 8 {
        assert!(Instant::now() < deadline, "acme's deliveries did not start");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let bound = Duration::from_secs(2);
    let mut waited = Vec::new();
    for (n, wait_for_breaker) in [(1, false), (2, true)] {
        if wait_for_breaker {
            // acme's breaker opens when its first deliveries time out, at about 3 s.
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let backed_off = stats_json(&server).await["backed_off"].take();
                if let Some([only]) = backed_off.as_array().map(Vec::as_slice) {
                    assert_eq!(only["destination"], "demo", "{backed_off}");
                    assert_eq!(only["scope"], "acme", "{backed_off}");
                    break;
                }
                assert_eq!(backed_off, serde_json::json!([]));
                assert!(Instant::now() < deadline, "acme's breaker did not open");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        let body = format!(r#"{{"id":"other_{n}"}}"#);
        let posted = Instant::now();
        let (code, answer) = post_for(&public, "demo", Some("globex"), &body, true).await;
        assert_eq!(code, 200, "{answer}");
        let key = format!("demo:globex:other_{n}");
        let arrived = arrival(&sink, &key, posted, Duration::from_secs(30)).await;
        eprintln!("globex's event {n} arrived after {arrived:?}");
        waited.push(arrived);
    }
    let acme = sink
        .received()
        .iter()
        .filter(|request| {
            request.headers.get("justonce-tenant").map(String::as_str) == Some("acme")
        })
        .count();
    server.stop().await;
    drop_database(db, &url).await;
    for (n, arrived) in waited.into_iter().enumerate() {
        let arrived = arrived.unwrap_or_else(|| panic!("globex's event {} never arrived", n + 1));
        assert!(
            arrived < bound,
            "globex's event {} waited {arrived:?} behind acme's backlog",
            n + 1
        );
    }
    // acme's lane had 8 in flight at a time; a few more started as the first ones failed,
    // before the fifth failure opened its breaker, whose 10 s pause outlasts the test.
    assert!((8..=16).contains(&acme), "{acme} deliveries of acme tried");
}

/// Waits until the Redis group of `stream` has read `entries` entries with none pending,
/// and `sink` has had `deliveries` requests.
async fn settled(
    redis: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    entries: usize,
    sink: &Sink,
    deliveries: usize,
) {
    use redis::AsyncCommands;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let groups: redis::streams::StreamInfoGroupsReply =
            redis.xinfo_groups(stream).await.unwrap();
        let settled = groups
            .groups
            .iter()
            .any(|group| group.entries_read == Some(entries) && group.pending == 0);
        if settled && sink.requests() >= deliveries {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the consumer did not settle the {entries} entries and deliver {deliveries}: {:?}",
            groups.groups
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The events the admin API lists, as (key, scope), and the listing as it came.
async fn listed_events(server: &Server) -> (Vec<(String, String)>, serde_json::Value) {
    let listed: serde_json::Value =
        serde_json::from_str(&text_of(&client(), &format!("{}/api/v1/events", server.admin)).await)
            .unwrap();
    let events = listed["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|event| {
            (
                event["key"].as_str().unwrap().to_owned(),
                event["scope"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    (events, listed)
}
