//! What a new user trips over in the first minutes: a misnamed configuration file, a
//! command run before the database exists, a database that cannot be reached, a misspelt
//! setting, a second run of `check`, and the words of the commands' answers.

use crate::folder::Folder;
use crate::serve::{Server, database, drop_database, free_port, post};
use justonce_sql::sqlx::{self, Postgres, Sqlite};
use justonce_tests::TestBackend;
use std::time::Duration;

/// `--config nope.toml` naming no file is bad usage, whatever the command: exit code 2, the
/// file and where it was named, and no database file made.
#[tokio::test]
async fn a_named_configuration_file_that_does_not_exist_exits_2_and_creates_nothing() {
    let folder = Folder::new("named-config");
    for args in [
        &["--config", "nope.toml", "check"][..],
        &["--config", "nope.toml", "stats"],
        &["--config", "nope.toml", "serve"],
        &["--config", "nope.toml", "config"],
    ] {
        let ran = folder.run(&[], args).await;
        assert_eq!(ran.code, 2, "{args:?}: {}", ran.stderr);
        assert_eq!(
            ran.stderr, "justonce: nope.toml (from --config): no such file\n",
            "{args:?}"
        );
        assert!(ran.stdout.is_empty(), "{args:?}: {}", ran.stdout);
    }
    // The variable may name an absent file, as the container image's does: `config` says
    // it is not found.
    let ran = folder
        .run(&[("JUSTONCE_CONFIG", "nope.toml")], &["config"])
        .await;
    assert_eq!(ran.code, 0, "{}", ran.stderr);
    assert!(
        ran.stdout
            .starts_with("# The configuration justonce runs with: nope.toml (not found),"),
        "{}",
        ran.stdout
    );
    assert_eq!(folder.entries(), Vec::<String>::new());
}

/// The default `justonce.toml` may be absent, and the default database is `justonce.db`:
/// a command that reads it, run before the first `migrate`, says how to make it and leaves
/// no empty file behind. `config` needs no database at all.
#[tokio::test]
async fn read_only_commands_create_no_database_file() {
    let folder = Folder::new("read-only");
    for args in [
        &["stats"][..],
        &["stats", "--json"],
        &["dlq", "list"],
        &["dlq", "show", "1"],
        &["keys", "show", "shop:1", "--consumer", "shop"],
        &["check"],
    ] {
        let ran = folder.run(&[], args).await;
        assert_eq!(ran.code, 1, "{args:?}: {}", ran.stderr);
        assert_eq!(
            ran.stderr,
            "justonce: the database file justonce.db does not exist: `justonce migrate` creates it\n",
            "{args:?}"
        );
    }
    let ran = folder.run(&[], &["config"]).await;
    assert_eq!(ran.code, 0, "{}", ran.stderr);
    assert_eq!(folder.entries(), Vec::<String>::new());

    let ran = folder.run(&[], &["migrate"]).await;
    assert_eq!(
        (ran.code, ran.stdout.as_str()),
        (0, "9 migrations applied\n")
    );
    let ran = folder.run(&[], &["check"]).await;
    assert_eq!(
        (ran.code, ran.stdout.as_str()),
        (
            0,
            "configuration and database are fine: 0 sources, 0 consumers, 0 brokers reached\n"
        ),
        "{}",
        ran.stderr
    );
}

/// Nothing listens on the port: every command that opens the database, and `check` with a
/// job whose effects are there, fails within 5 s with one line naming the host, the port
/// and the refusal.
#[tokio::test]
async fn an_unreachable_database_fails_within_5_s_naming_host_and_port() {
    let folder = Folder::new("unreachable");
    let port = free_port();
    for url in [
        format!("postgres://postgres@127.0.0.1:{port}/test"),
        format!("mysql://root@127.0.0.1:{port}/test"),
    ] {
        for command in ["stats", "check", "serve"] {
            let ran = folder
                .run(&[("JUSTONCE_SERVER_DATABASE", &url)], &[command])
                .await;
            assert_eq!(ran.code, 1, "{url} {command}: {}", ran.stderr);
            assert!(
                ran.took < Duration::from_secs(5),
                "{url} {command}: {:?}",
                ran.took
            );
            assert_eq!(
                ran.stderr,
                format!(
                    "justonce: opening the database at 127.0.0.1:{port}: Connection refused (os error 111)\n"
                ),
                "{url} {command}"
            );
        }
        let job = [
            "--config",
            "/dev/null",
            "check",
            "--run",
            "true",
            "--effects",
            "SELECT 1",
        ];
        let ran = folder
            .run(
                &[],
                &[&job[..], &["--events", "1", "--database", &url]].concat(),
            )
            .await;
        assert_eq!(ran.code, 1, "{url}: {}", ran.stderr);
        assert!(ran.took < Duration::from_secs(5), "{url}: {:?}", ran.took);
        assert_eq!(
            ran.stderr,
            format!(
                "justonce: opening the effects database at 127.0.0.1:{port}: Connection refused (os error 111)\n"
            ),
            "{url}"
        );
    }
}

/// A database the server says is not there: its own words once, without the driver's
/// wrapping, the chain of causes, or PostgreSQL's `at line N` of its source code.
#[tokio::test]
async fn a_database_error_is_said_once_in_the_servers_words() {
    let folder = Folder::new("database-error");
    let cases = [
        (
            "postgres://postgres@127.0.0.1:5432/justonce_no_such_database",
            "justonce: opening the database at 127.0.0.1:5432: database \"justonce_no_such_database\" does not exist\n",
        ),
        (
            "mysql://root@127.0.0.1:3306/justonce_no_such_database",
            "justonce: opening the database at 127.0.0.1:3306: Unknown database 'justonce_no_such_database'\n",
        ),
    ];
    for (url, expected) in cases {
        let ran = folder
            .run(&[("JUSTONCE_SERVER_DATABASE", url)], &["stats"])
            .await;
        assert_eq!((ran.code, ran.stderr.as_str()), (1, expected), "{url}");
    }
}

/// A SQLite file in a folder that does not exist: `serve` and `migrate` name the file and
/// the missing folder.
#[tokio::test]
async fn a_sqlite_file_in_a_missing_folder_is_named() {
    let folder = Folder::new("sqlite-folder");
    let missing = folder.path("missing");
    let url = format!("sqlite://{missing}/justonce.db");
    for command in ["serve", "migrate"] {
        let ran = folder
            .run(&[("JUSTONCE_SERVER_DATABASE", &url)], &[command])
            .await;
        assert_eq!(ran.code, 1, "{command}: {}", ran.stderr);
        assert_eq!(
            ran.stderr,
            format!(
                "justonce: opening the database file {missing}/justonce.db: its folder {missing} does not exist\n"
            ),
            "{command}"
        );
    }
}

/// A misspelt scheme is the mistake named, not a setting that only applies to another
/// scheme.
#[tokio::test]
async fn a_misspelt_scheme_names_the_scheme() {
    let folder = Folder::new("scheme");
    std::fs::write(
        folder.dir.join("justonce.toml"),
        r#"
[sources.shop]
scheme = "hmac-sha265"
signature_header = "X-Shop-Signature"
secrets = ["env:SHOP_SECRET"]
id = "json:/id"
target = "http://127.0.0.1:9000/shop"
"#,
    )
    .unwrap();
    let ran = folder
        .run(&[("SHOP_SECRET", "a secret of sixteen bytes")], &["check"])
        .await;
    assert_eq!(ran.code, 2, "{}", ran.stderr);
    assert_eq!(
        ran.stderr,
        "justonce: justonce.toml: sources.shop.scheme (line 3): \"hmac-sha265\" is not one of \
         standard-webhooks, stripe, github, hmac-sha256, none\n"
    );
}

/// An effects query that names events by number finds the rows of an earlier run before
/// a second one starts: the check says that is the cause, not that its keys were seen.
#[tokio::test]
async fn a_second_check_names_the_rows_an_earlier_run_left() {
    let folder = Folder::new("second-check");
    let effects = format!("sqlite://{}?mode=rwc", folder.path("effects.db"));
    let pool = sqlx::SqlitePool::connect(&effects).await.unwrap();
    for statement in [
        "CREATE TABLE shipments (n INTEGER NOT NULL, order_id TEXT NOT NULL)",
        // What a first run of three events left.
        "INSERT INTO shipments VALUES (1, 'check-0a1b2c3d-1'), (2, 'check-0a1b2c3d-2'), \
         (3, 'check-0a1b2c3d-3')",
    ] {
        sqlx::query(statement).execute(&pool).await.unwrap();
    }
    pool.close().await;
    let check = |query: &'static str, keys: Option<&'static str>| {
        let effects = effects.clone();
        let folder = &folder;
        async move {
            let mut args = vec!["--config", "/dev/null", "check", "--run", "true"];
            args.extend(["--effects", query, "--database", &effects]);
            match keys {
                Some(keys) => args.extend(["--keys", keys]),
                None => args.extend(["--events", "3"]),
            }
            folder.run(&[], &args).await
        }
    };
    let ran = check("SELECT n FROM shipments", None).await;
    assert_eq!(ran.code, 2, "{}", ran.stderr);
    assert_eq!(
        ran.stderr,
        "justonce: the effects query already returns \"1\" before the check: its rows name \
         events by number, so rows an earlier run left count as this run's; delete them \
         first, or return each event's key\n"
    );
    let ran = check(
        "SELECT order_id FROM shipments",
        Some("check-0a1b2c3d-2,fresh"),
    )
    .await;
    assert_eq!(ran.code, 2, "{}", ran.stderr);
    assert_eq!(
        ran.stderr,
        "justonce: event 1 (check-0a1b2c3d-2) already has effects before the check: delete \
         them, or choose --keys that no run has used\n"
    );
}

/// clap reads `{n}` in help as a line break: the placeholders show as written.
#[tokio::test]
async fn check_help_shows_the_placeholders_as_written() {
    let folder = Folder::new("help");
    let ran = folder.run(&[], &["check", "--help"]).await;
    assert_eq!(ran.code, 0, "{}", ran.stderr);
    for expected in [
        "a shell command run once per try, with `{key}` and `{n}` replaced and the key in \
         JUSTONCE_CHECK_KEY",
        "The body of each try, with `{key}` and `{n}` (the event's number from 1) replaced",
        "as `Name: value`, with `{key}` and `{n}` replaced; repeatable",
    ] {
        assert!(
            ran.stdout.contains(expected),
            "{expected:?} not in\n{}",
            ran.stdout
        );
    }
}

/// A new database: `stats` shows no age for nothing due and `dlq list` says there is none.
/// One dead letter: a table with a header, and counts in words (`1 attempt`).
#[tokio::test]
async fn stats_and_dead_letters_answer_in_words() {
    let folder = Folder::new("words");
    assert_eq!(folder.run(&[], &["migrate"]).await.code, 0);
    let ran = folder.run(&[], &["stats"]).await;
    assert_eq!(ran.code, 0, "{}", ran.stderr);
    let deliveries: Vec<&str> = ran
        .stdout
        .lines()
        .skip_while(|line| *line != "deliveries")
        .take(3)
        .collect();
    assert_eq!(
        deliveries,
        [
            "deliveries",
            "  sent  due  dead  oldest due",
            "  0     0    0     (none)"
        ],
        "{}",
        ran.stdout
    );
    let ran = folder.run(&[], &["dlq", "list"]).await;
    assert_eq!((ran.code, ran.stdout.trim_end()), (0, "dead letters: none"));

    let url = format!("sqlite://{}", folder.path("justonce.db"));
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO justonce_outbox (scope, key, destination, payload, attempts, last_error, dead)
         VALUES ('', 'shop:evt_1', 'shop', '{}', 1, 'HTTP 500', TRUE) RETURNING id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    pool.close().await;
    let ran = folder.run(&[], &["dlq", "list"]).await;
    assert_eq!(ran.code, 0, "{}", ran.stderr);
    assert_eq!(
        ran.stdout.lines().take(3).collect::<Vec<_>>(),
        [
            "dead letters",
            "  id  destination  key         attempts  last error",
            &format!("  {id:<2}  shop         shop:evt_1  1         HTTP 500"),
        ],
        "{}",
        ran.stdout
    );
    let ran = folder.run(&[], &["dlq", "show", &id.to_string()]).await;
    assert!(
        ran.stdout.contains("state:       dead after 1 attempt\n"),
        "{}",
        ran.stdout
    );
    let ran = folder.run(&[], &["dlq", "replay", "--all"]).await;
    assert_eq!(ran.stdout, "1 dead letter is due again\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_on_sqlite_warns_once_per_key_reuse_and_says_stopped() {
    serve_warns_once_per_key_reuse_and_says_stopped::<Sqlite>("first_run_serve").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_on_postgres_warns_once_per_key_reuse_and_says_stopped() {
    serve_warns_once_per_key_reuse_and_says_stopped::<Postgres>("first_run_serve").await;
}

/// `serve` on a migrated database, at its default log level: no notice from the driver at
/// start, one warning for one event sent again with another body, and `stopped` at the end.
async fn serve_warns_once_per_key_reuse_and_says_stopped<DB: TestBackend>(test: &str) {
    let (db, url) = database::<DB>(test).await;
    let mut server = Server::configure(&url, "http://127.0.0.1:1/unused");
    let (code, _, stderr) = crate::serve::run_capturing(&server, &["migrate"]).await;
    assert_eq!(code, 0, "{stderr}");
    let lines = server.start_logged(&[], &[]).await;
    let client = crate::serve::client();
    let first = post(&client, &server.public, r#"{"id":"evt_1","amount":1}"#).await;
    let again = post(&client, &server.public, r#"{"id":"evt_1","amount":2}"#).await;
    assert_eq!(first.unwrap(), (200, "accepted".to_owned()));
    assert_eq!(again.unwrap(), (200, "key_reused".to_owned()));
    server.stop().await;
    let lines = lines.await.unwrap();
    let all = lines.join("\n");
    assert!(!all.contains("notice"), "{all}");
    let warned: Vec<&String> = lines
        .iter()
        .filter(|line| line.contains("different"))
        .collect();
    assert_eq!(warned.len(), 1, "{all}");
    assert!(warned[0].contains("key=demo:evt_1"), "{all}");
    assert!(
        lines.last().is_some_and(|line| line.ends_with(" stopped")),
        "{all}"
    );
    drop_database(db, &url).await;
}
