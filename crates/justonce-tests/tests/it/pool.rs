//! The inbox's pool: a connection the server ended while it sat in the pool is replaced
//! before anything is lost, found broken by a transaction's BEGIN or by a ping.

use super::{key, process};
use justonce_sql::{Consumer, Inbox, InboxOptions, Message, Outcome};
use justonce_tests::{TestBackend, TestDb};
use std::time::Duration;

/// Each test on the servers whose connections can break: PostgreSQL and MariaDB.
macro_rules! on_servers {
    ($($test:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test::<sqlx::Postgres>(stringify!($test), &super::POSTGRES).await
                }
            )*
        }
        mod mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test::<sqlx::MySql>(stringify!($test), &super::MARIADB).await
                }
            )*
        }
    };
}

on_servers!(
    a_connection_ended_while_idle_is_replaced_at_begin,
    a_forward_on_a_connection_ended_while_idle_is_stored_once,
    a_shared_forward_on_a_connection_ended_while_idle_is_stored_once,
    a_statement_outside_a_transaction_gets_a_connection_that_answers,
);

/// How a server names a connection and ends another one.
struct Server {
    /// The connection's own id, as a signed 64-bit number.
    own_id: &'static str,
    end: fn(i64) -> String,
    /// How many connections have that id: 0 once it is gone.
    open: fn(i64) -> String,
}

const POSTGRES: Server = Server {
    own_id: "SELECT pg_backend_pid()::bigint",
    end: |id| format!("SELECT pg_terminate_backend({id})"),
    open: |id| format!("SELECT count(*) FROM pg_stat_activity WHERE pid = {id}"),
};

const MARIADB: Server = Server {
    own_id: "SELECT CAST(CONNECTION_ID() AS SIGNED)",
    end: |id| format!("KILL CONNECTION {id}"),
    open: |id| {
        format!(
            "SELECT CAST(count(*) AS SIGNED) FROM information_schema.processlist WHERE id = {id}"
        )
    },
};

/// A test's tables, an inbox on them with `options` whose pool holds one connection, and
/// that connection's id, once the server has ended it while it sat idle in the pool.
async fn one_connection_ended<DB: TestBackend>(
    test: &str,
    server: &Server,
    options: InboxOptions,
) -> (TestDb<DB>, Inbox<DB>, i64) {
    let db = TestDb::<DB>::new(test).await;
    let options = options.prefix(&db.prefix).pool_size(1);
    let inbox = Inbox::connect_with(&db.url, Consumer::new("test").unwrap(), options)
        .await
        .expect("connect");
    let ended = end_the_idle_connection(&db, &inbox, server).await;
    (db, inbox, ended)
}

/// Closes the test's own pool, then drops its tables.
async fn close<DB: TestBackend>(db: TestDb<DB>, inbox: Inbox<DB>) {
    inbox.pool().close().await;
    db.cleanup().await;
}

/// Ends the only connection of `inbox`'s pool from `db`'s own pool while it sits idle, and
/// waits until the server has let it go. Returns its id.
async fn end_the_idle_connection<DB: TestBackend>(
    db: &TestDb<DB>,
    inbox: &Inbox<DB>,
    server: &Server,
) -> i64 {
    let id = DB::count(inbox.pool(), server.own_id.to_owned()).await;
    // sqlx puts a connection back once it answered a ping: then it sits idle.
    while inbox.pool().num_idle() < 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    DB::execute(db.inbox.pool(), (server.end)(id))
        .await
        .expect("end the connection");
    for _ in 0..500 {
        if DB::count(db.inbox.pool(), (server.open)(id)).await == 0 {
            assert_eq!(
                inbox.pool().num_idle(),
                1,
                "the ended connection is still pooled"
            );
            return id;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("connection {id} was not ended within 5 s");
}

/// A connection ended while idle: the run's BEGIN, unpinged, finds it broken and takes
/// another, and the message takes effect once.
async fn a_connection_ended_while_idle_is_replaced_at_begin<DB: TestBackend>(
    test: &str,
    server: &Server,
) {
    let (db, inbox, _) = one_connection_ended::<DB>(test, server, InboxOptions::default()).await;
    let id = key("charge:after-the-end");
    assert_eq!(
        process(&db, &inbox, &id, b"p").await,
        Outcome::Processed(())
    );
    assert_eq!(db.effects_of(&id).await, 1);
    assert_eq!(process(&db, &inbox, &id, b"p").await, Outcome::Duplicate);
    close(db, inbox).await;
}

/// The same, for a webhook's forward: on PostgreSQL its one statement runs outside a
/// transaction, on a connection that answered a ping, and writes the outbox row once.
async fn a_forward_on_a_connection_ended_while_idle_is_stored_once<DB: TestBackend>(
    test: &str,
    server: &Server,
) {
    forwarded_once::<DB>(test, server, InboxOptions::default()).await
}

/// The same, with commits shared as the webhook receiver shares them: on MariaDB the
/// group's transaction begins unpinged, finds the connection broken and takes another.
async fn a_shared_forward_on_a_connection_ended_while_idle_is_stored_once<DB: TestBackend>(
    test: &str,
    server: &Server,
) {
    let options = InboxOptions::default().share_commits(true);
    forwarded_once::<DB>(test, server, options).await
}

/// A forward, then the same again, on an inbox with `options` whose only connection was
/// ended while idle: processed, then a duplicate, and one outbox row.
async fn forwarded_once<DB: TestBackend>(test: &str, server: &Server, options: InboxOptions) {
    let (db, inbox, _) = one_connection_ended::<DB>(test, server, options).await;
    let id = key("shop:evt_after_the_end");
    let message = Message::new("shop", "body");
    let forwarded = inbox.run_forward(&id, b"body", message.clone()).await;
    assert_eq!(forwarded.expect("forward"), Outcome::Processed(()));
    let again = inbox.run_forward(&id, b"body", message).await;
    assert_eq!(again.expect("forward again"), Outcome::Duplicate);
    assert_eq!(db.rows("outbox").await, 1);
    close(db, inbox).await;
}

/// A statement outside a transaction gets a connection that answered a ping: one ended
/// while idle is closed, and the statement runs on a new one instead of failing.
async fn a_statement_outside_a_transaction_gets_a_connection_that_answers<DB: TestBackend>(
    test: &str,
    server: &Server,
) {
    let (db, inbox, ended) =
        one_connection_ended::<DB>(test, server, InboxOptions::default()).await;
    let now = DB::count(inbox.pool(), server.own_id.to_owned()).await;
    assert_ne!(now, ended, "the statement ran on a new connection");
    close(db, inbox).await;
}
