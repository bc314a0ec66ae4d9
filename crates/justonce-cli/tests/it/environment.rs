//! `justonce` configured by environment variables alone, with no configuration file: a
//! webhook source, a broker consumer and the relay; `DATABASE_URL`; `justonce config`; and
//! variables that name no setting.

use crate::folder::{Folder, Ran};
use crate::serve::{
    SECRET, await_keys, client, database, drop_database, free_port, post, redis_orders,
};
use justonce_tests::Sink;
use std::process::Stdio;
use std::time::Duration;

/// The variables of a webhook source `demo` signed with HMAC-SHA256, delivering to `target`.
fn demo_source(target: &str) -> Vec<(&'static str, String)> {
    vec![
        ("DEMO_SECRET", SECRET.to_owned()),
        ("JUSTONCE_SOURCES_DEMO_SCHEME", "hmac-sha256".to_owned()),
        (
            "JUSTONCE_SOURCES_DEMO_SECRETS",
            "env:DEMO_SECRET".to_owned(),
        ),
        ("JUSTONCE_SOURCES_DEMO_ID", "json:/id".to_owned()),
        ("JUSTONCE_SOURCES_DEMO_TARGET", target.to_owned()),
    ]
}

fn borrowed<'a>(vars: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    vars.iter()
        .map(|(name, value)| (*name, value.as_str()))
        .collect()
}

/// No file: a signed webhook and a Redis Streams entry each reach the target once, the
/// source, the consumer and the database all set by variables, the database by
/// `DATABASE_URL`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_a_consumer_and_the_relay_run_from_variables_alone() {
    use redis::AsyncCommands;
    let (db, url) = database::<justonce_sql::sqlx::Postgres>("variables-alone").await;
    let sink = Sink::start().await;
    let redis_url = justonce_tests::redis_url();
    let stream = format!("{}orders", db.prefix);
    // Added before the service starts: its group begins at the start of the stream.
    let mut redis = redis_orders(&stream).await;
    let (public, admin) = (free_port(), free_port());
    let mut vars = demo_source(&sink.url());
    vars.extend([
        ("DATABASE_URL", url.clone()),
        ("JUSTONCE_SERVER_LISTEN", format!("127.0.0.1:{public}")),
        ("JUSTONCE_SERVER_ADMIN_LISTEN", format!("127.0.0.1:{admin}")),
        ("JUSTONCE_CONSUMERS_ORDER_EVENTS_FROM", redis_url.clone()),
        ("JUSTONCE_CONSUMERS_ORDER_EVENTS_STREAM", stream.clone()),
        (
            "JUSTONCE_CONSUMERS_ORDER_EVENTS_ID",
            "header:order_id".to_owned(),
        ),
        ("JUSTONCE_CONSUMERS_ORDER_EVENTS_TARGET", sink.url()),
    ]);
    let vars = borrowed(&vars);
    let bare = Folder::new("environment");
    let mut serve = bare
        .command(&vars, &["serve"])
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start justonce");
    let public = format!("http://127.0.0.1:{public}");
    let client = client();
    let mut up = false;
    for _ in 0..600 {
        let health = client.get(format!("{public}/healthz")).send().await;
        if health.is_ok_and(|r| r.status().is_success()) {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(up, "justonce serve did not come up");

    let body = r#"{"id":"evt_1"}"#;
    assert_eq!(
        post(&client, &public, body).await.unwrap(),
        (200, "accepted".into())
    );
    assert_eq!(
        post(&client, &public, body).await.unwrap(),
        (200, "duplicate".into())
    );
    let by_key = await_keys(&sink, 3).await;
    let mut keys: Vec<&str> = by_key.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        ["demo:evt_1", "order_events:order-1", "order_events:order-2"]
    );
    assert_eq!(by_key["demo:evt_1"], [body.as_bytes()]);
    assert_eq!(
        by_key["order_events:order-2"],
        [br#"{"order":"order-2"}"#.as_slice()]
    );
    // The relay records the deliveries as sent a moment after the target has them: by then
    // each was sent once.
    let mut deliveries = serde_json::Value::Null;
    for _ in 0..300 {
        let Ran {
            code,
            stdout: printed,
            stderr,
            ..
        } = bare.run(&vars, &["stats", "--json"]).await;
        assert_eq!(code, 0, "{stderr}");
        let stats: serde_json::Value = serde_json::from_str(&printed).unwrap();
        deliveries = stats["deliveries"].clone();
        if deliveries["sent"] == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(deliveries["sent"], 3, "{deliveries}");
    assert_eq!(deliveries["dead"], 0, "{deliveries}");
    assert_eq!(sink.requests(), 3, "each event reached the target once");

    let pid = serve.id().unwrap().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = tokio::time::timeout(Duration::from_secs(30), serve.wait())
        .await
        .expect("serve stops on SIGTERM")
        .unwrap();
    assert!(status.success(), "serve exited with {status:?}");
    let _: () = redis.del(&stream).await.unwrap();
    drop_database(db, &url).await;
}

/// A bad value in a variable stops the service at start with exit code 2, naming the
/// variable and the setting.
#[tokio::test]
async fn a_bad_variable_exits_2_naming_it() {
    let source = demo_source("http://127.0.0.1:1/demo");
    for (variable, value, expected) in [
        (
            "JUSTONCE_SOURCES_DEMO_RETENTION",
            "5",
            "sources.demo.retention (from JUSTONCE_SOURCES_DEMO_RETENTION): \"5\" needs a unit",
        ),
        (
            "JUSTONCE_SERVER_POOL_SIZE",
            "ten",
            "server.pool_size (from JUSTONCE_SERVER_POOL_SIZE): \"ten\" is not a whole number",
        ),
        (
            "JUSTONCE_SOURCES_DEMO_SCHEME",
            "magic",
            "sources.demo.scheme (from JUSTONCE_SOURCES_DEMO_SCHEME): \"magic\" is not one of",
        ),
    ] {
        let mut vars = borrowed(&source);
        vars.push((variable, value));
        let Ran { code, stderr, .. } = Folder::new("environment").run(&vars, &["serve"]).await;
        assert_eq!(code, 2, "{variable}: {stderr}");
        assert!(stderr.contains(expected), "{expected:?} not in {stderr:?}");
    }
    // A source declared by a variable, missing a setting, names the variable to set.
    let mut vars = borrowed(&source);
    vars.retain(|(name, _)| *name != "JUSTONCE_SOURCES_DEMO_TARGET");
    let Ran { code, stderr, .. } = Folder::new("environment").run(&vars, &["serve"]).await;
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("sources.demo.target (JUSTONCE_SOURCES_DEMO_TARGET): is required"),
        "{stderr}"
    );
}

/// `DATABASE_URL` names the database when nothing else does; `JUSTONCE_SERVER_DATABASE`
/// wins over it. Each SQLite file exists only if `migrate` used it.
#[tokio::test]
async fn database_url_is_used_and_the_setting_wins_over_it() {
    let bare = Folder::new("environment");
    let file = |name: &str| bare.dir.join(name);
    let url = |name: &str| format!("sqlite://{}", file(name).display());
    let from_url = [("DATABASE_URL", url("from-url.db"))];
    let both = [
        ("DATABASE_URL", url("ignored.db")),
        ("JUSTONCE_SERVER_DATABASE", url("chosen.db")),
    ];
    for (vars, chosen, origin) in [
        (&from_url[..], "from-url.db", "DATABASE_URL"),
        (&both[..], "chosen.db", "JUSTONCE_SERVER_DATABASE"),
    ] {
        let vars = borrowed(vars);
        let Ran {
            code,
            stdout,
            stderr,
            ..
        } = bare.run(&vars, &["migrate"]).await;
        assert_eq!(
            (code, stdout.as_str()),
            (0, "9 migrations applied\n"),
            "{stderr}"
        );
        assert!(file(chosen).exists(), "{chosen} was not used");
        let Ran {
            code,
            stdout: printed,
            ..
        } = bare.run(&vars, &["config"]).await;
        assert_eq!(code, 0);
        let expected = format!("database = \"{}\"  # from {origin}", url(chosen));
        assert!(
            printed.contains(&expected),
            "{expected:?} not in\n{printed}"
        );
    }
    assert!(
        !file("ignored.db").exists(),
        "DATABASE_URL won over the setting"
    );
}

/// `justonce config` shows each value with its origin, a secret by its reference and a URL
/// without its password, and what it prints is TOML.
#[tokio::test]
async fn config_prints_each_origin_and_never_a_secret() {
    let (database_password, broker_password) = ("pg-pass-9f3e1", "mq-pass-27c4d");
    let target_secret = "whsec_dGFyZ2V0LXNlY3JldC12YWx1ZQ==";
    let database_url = format!("postgres://app:{database_password}@127.0.0.1:5432/app");
    let broker_url = format!("amqp://guest:{broker_password}@127.0.0.1:5672/%2f");
    let mut vars = demo_source("http://127.0.0.1:9000/demo");
    vars.retain(|(name, _)| !name.starts_with("JUSTONCE_SOURCES_DEMO_S"));
    vars.extend([
        ("DATABASE_URL", database_url),
        ("JUSTONCE_SERVER_ADMIN_LISTEN", "127.0.0.1:19090".to_owned()),
        ("JUSTONCE_CONSUMERS_ORDERS_FROM", broker_url),
        ("JUSTONCE_CONSUMERS_ORDERS_QUEUE", "orders".to_owned()),
        (
            "JUSTONCE_CONSUMERS_ORDERS_TARGET",
            "http://127.0.0.1:9000/o".to_owned(),
        ),
        ("ORDERS_TARGET_SECRET", target_secret.to_owned()),
        (
            "JUSTONCE_CONSUMERS_ORDERS_TARGET_SECRET",
            "env:ORDERS_TARGET_SECRET".to_owned(),
        ),
    ]);
    let vars = borrowed(&vars);
    let bare = Folder::new("environment");
    std::fs::write(
        bare.dir.join("justonce.toml"),
        "[server]\nlisten = \"127.0.0.1:18080\"\n\n[sources.demo]\nscheme = \"hmac-sha256\"\n\
         secrets = [\"env:DEMO_SECRET\"]\n",
    )
    .unwrap();
    let Ran {
        code,
        stdout: printed,
        stderr,
        ..
    } = bare.run(&vars, &["config"]).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(!stderr.contains("WARN"), "{stderr}");
    for line in [
        "listen = \"127.0.0.1:18080\"  # justonce.toml, line 2",
        "admin_listen = \"127.0.0.1:19090\"  # from JUSTONCE_SERVER_ADMIN_LISTEN",
        "database = \"postgres://app:***@127.0.0.1:5432/app\"  # from DATABASE_URL",
        "pool_size = 10  # default",
        "[sources.demo]",
        "secrets = [\"env:DEMO_SECRET\"]  # justonce.toml, line 6",
        "id = \"json:/id\"  # from JUSTONCE_SOURCES_DEMO_ID",
        "retention = \"7d\"  # default",
        "[consumers.orders]",
        "from = \"amqp://guest:***@127.0.0.1:5672/%2f\"  # from JUSTONCE_CONSUMERS_ORDERS_FROM",
        "target_secret = \"env:ORDERS_TARGET_SECRET\"  # from JUSTONCE_CONSUMERS_ORDERS_TARGET_SECRET",
    ] {
        assert!(
            printed.lines().any(|l| l == line),
            "{line:?} not in\n{printed}"
        );
    }
    for secret in [SECRET, database_password, broker_password, target_secret] {
        assert!(!printed.contains(secret), "{secret:?} printed:\n{printed}");
    }
    let parsed: toml::Table = toml::from_str(&printed).expect("TOML");
    assert_eq!(
        parsed["consumers"]["orders"]["queue"].as_str(),
        Some("orders")
    );
}

/// A `JUSTONCE_*` variable that names no setting is a warning naming it; with `--strict`
/// (or `JUSTONCE_STRICT`) it stops the command with exit code 2. The variables justonce
/// reads elsewhere are not reported.
#[tokio::test]
async fn an_unknown_variable_warns_and_strict_refuses_it() {
    let vars = [
        ("JUSTONCE_SERVER_LISTN", "127.0.0.1:18080"),
        ("JUSTONCE_LOG_FORMAT", "json"),
        ("JUSTONCE_CONFIG", "justonce.toml"),
    ];
    let bare = Folder::new("environment");
    let Ran { code, stderr, .. } = bare.run(&vars, &["config"]).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.contains("JUSTONCE_SERVER_LISTN: no setting has this name; it is ignored"),
        "{stderr}"
    );
    assert!(!stderr.contains("JUSTONCE_LOG_FORMAT"), "{stderr}");
    assert!(!stderr.contains("JUSTONCE_CONFIG"), "{stderr}");

    let Ran {
        code,
        stdout,
        stderr,
        ..
    } = bare.run(&vars, &["--strict", "config"]).await;
    assert_eq!(code, 2, "{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    assert!(
        stderr.contains("JUSTONCE_SERVER_LISTN: no setting has this name (refused by --strict)"),
        "{stderr}"
    );
    let strict = [&vars[..], &[("JUSTONCE_STRICT", "true")]].concat();
    let Ran { code, stderr, .. } = bare.run(&strict, &["config"]).await;
    assert_eq!(code, 2, "{stderr}");
    // Without the unknown one, --strict has nothing to refuse.
    let Ran { code, stderr, .. } = bare.run(&vars[1..], &["--strict", "config"]).await;
    assert_eq!(code, 0, "{stderr}");
}
