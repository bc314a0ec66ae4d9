//! `Inbox::run_effect`: the claim and one statement of the user's, once per key; on
//! PostgreSQL one statement, elsewhere a transaction.

use super::{key, on_every_database};
use justonce_sql::{Effect, Error, Outcome};
use justonce_tests::{TestBackend, TestDb};
use sqlx::Postgres;
use sqlx::{Encode, Type};

on_every_database!(
    an_effect_runs_once_and_a_duplicate_changes_nothing,
    an_update_reads_claimed_in_each_dialect,
    racing_effects_on_one_key_make_one_effect,
    a_failing_effect_leaves_no_claim,
    a_statement_without_claimed_is_refused_before_it_is_sent,
    claimed_as_a_column_or_an_alias_is_refused_before_it_is_sent,
    an_effect_that_writes_without_a_claim_writes_once,
    claimed_takes_an_alias,
    two_statements_are_refused_before_they_are_sent,
    one_statement_for_many_keys_writes_each_keys_own_row,
);

/// The effect of the tests: one row in the effect table for `msg_key`, with `consumer`.
fn insert_effect<DB: TestBackend>(prefix: &str, consumer: Option<&str>, msg_key: &str) -> Effect<DB>
where
    for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
{
    let [first, second] = DB::PARAMETERS;
    Effect::new(format!(
        "INSERT INTO {prefix}effects (consumer, msg_key) SELECT {first}, {second} FROM claimed"
    ))
    .bind(consumer.map(str::to_owned))
    .bind(Some(msg_key.to_owned()))
}

async fn an_effect_runs_once_and_a_duplicate_changes_nothing<DB: TestBackend>(test: &str)
where
    for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
{
    let db = TestDb::<DB>::new(test).await;
    let payment = key("payment:1");
    let effect = insert_effect::<DB>(&db.prefix, Some("test"), payment.as_str());
    let first = db.inbox.run_effect(&payment, b"p", &effect).await.unwrap();
    assert_eq!(first, Outcome::Processed(Some(1)));
    // Another process knows nothing of this one's recent keys: the database answers.
    let other = TestDb::<DB>::reopen(&db.url, &db.prefix).await;
    let again = other.inbox.run_effect(&payment, b"p", &effect).await;
    assert_eq!(again.unwrap(), Outcome::Duplicate);
    let reused = other.inbox.run_effect(&payment, b"other", &effect).await;
    assert!(matches!(reused.unwrap(), Outcome::KeyReused { .. }));
    // This process answers from its recent keys.
    let remembered = db.inbox.run_effect(&payment, b"p", &effect).await;
    assert_eq!(remembered.unwrap(), Outcome::Duplicate);
    assert_eq!(
        (db.rows("keys").await, db.effects_of(&payment).await),
        (1, 1)
    );
    db.cleanup().await;
}

/// A consumer sends the same statement for every message, each with its own binds: each
/// key gets the row its binds make, and a refused statement stays refused.
async fn one_statement_for_many_keys_writes_each_keys_own_row<DB: TestBackend>(test: &str)
where
    for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
{
    let db = TestDb::<DB>::new(test).await;
    let payments = [key("payment:11"), key("payment:12"), key("payment:13")];
    for payment in &payments {
        let effect = insert_effect::<DB>(&db.prefix, Some("test"), payment.as_str());
        let outcome = db.inbox.run_effect(payment, b"p", &effect).await;
        assert_eq!(outcome.unwrap(), Outcome::Processed(Some(1)));
    }
    for payment in &payments {
        assert_eq!(db.effects_of(payment).await, 1, "{payment}");
    }
    let [first, _] = DB::PARAMETERS;
    let prefix = &db.prefix;
    let blind = format!("INSERT INTO {prefix}effects (consumer, msg_key) VALUES ('x', {first})");
    for payment in [key("payment:14"), key("payment:15")] {
        let effect = Effect::<DB>::new(blind.as_str()).bind(Some(payment.as_str().to_owned()));
        let error = db.inbox.run_effect(&payment, b"p", &effect).await;
        assert!(
            matches!(error, Err(Error::InvalidStatement(_))),
            "{error:?}"
        );
    }
    assert_eq!((db.rows("keys").await, db.rows("effects").await), (3, 3));
    db.cleanup().await;
}

/// An UPDATE as each database writes one with another table: `claimed` joins it, and the
/// outcome carries the rows it changed.
async fn an_update_reads_claimed_in_each_dialect<DB: TestBackend>(test: &str)
where
    for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
{
    let db = TestDb::<DB>::new(test).await;
    let prefix = &db.prefix;
    for account in ["acct_1", "acct_2"] {
        let sql =
            format!("INSERT INTO {prefix}effects (consumer, msg_key) VALUES ('new', '{account}')");
        DB::execute(db.inbox.pool(), sql).await.unwrap();
    }
    let [first, second] = DB::PARAMETERS;
    let sql = if <DB as sqlx::Database>::NAME == "MySQL" {
        format!("UPDATE {prefix}effects, claimed SET consumer = {first} WHERE msg_key = {second}")
    } else {
        format!(
            "UPDATE {prefix}effects SET consumer = {first} FROM claimed WHERE msg_key = {second}"
        )
    };
    let effect = Effect::<DB>::new(sql)
        .bind(Some("paid".to_owned()))
        .bind(Some("acct_1".to_owned()));
    let payment = key("payment:2");
    let outcome = db.inbox.run_effect(&payment, b"p", &effect).await.unwrap();
    assert_eq!(outcome, Outcome::Processed(Some(1)));
    let other = TestDb::<DB>::reopen(&db.url, &db.prefix).await;
    let again = other.inbox.run_effect(&payment, b"p", &effect).await;
    assert_eq!(again.unwrap(), Outcome::Duplicate);
    let consumers = DB::texts(
        db.inbox.pool(),
        format!("SELECT consumer FROM {prefix}effects ORDER BY msg_key"),
    )
    .await
    .unwrap();
    assert_eq!(consumers, ["paid", "new"]);
    db.cleanup().await;
}

/// Sixteen tasks run the same key at once: one effect, the others told it is a duplicate.
async fn racing_effects_on_one_key_make_one_effect<DB: TestBackend>(test: &str)
where
    for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
{
    let db = TestDb::<DB>::new(test).await;
    let payment = key("payment:3");
    let effect = insert_effect::<DB>(&db.prefix, Some("test"), payment.as_str());
    let runs = (0..16).map(|_| {
        let (inbox, payment, effect) = (db.inbox.clone(), payment.clone(), effect.clone());
        tokio::spawn(async move { inbox.run_effect(&payment, b"p", &effect).await })
    });
    let mut processed = 0;
    for run in futures_util::future::join_all(runs).await {
        match run.unwrap().unwrap() {
            Outcome::Processed(Some(1)) => processed += 1,
            Outcome::Duplicate => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(processed, 1);
    assert_eq!(
        (db.rows("keys").await, db.effects_of(&payment).await),
        (1, 1)
    );
    db.cleanup().await;
}

/// A statement the database refuses (NULL in a NOT NULL column) is the run's error, and
/// the key stays free for a later run.
async fn a_failing_effect_leaves_no_claim<DB: TestBackend>(test: &str)
where
    for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
{
    let db = TestDb::<DB>::new(test).await;
    let payment = key("payment:4");
    let failing = insert_effect::<DB>(&db.prefix, None, payment.as_str());
    let error = db
        .inbox
        .run_effect(&payment, b"p", &failing)
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            Error::Database {
                retryable: false,
                ..
            }
        ),
        "{error:?}"
    );
    assert_eq!((db.rows("keys").await, db.rows("effects").await), (0, 0));
    let fixed = insert_effect::<DB>(&db.prefix, Some("test"), payment.as_str());
    let outcome = db.inbox.run_effect(&payment, b"p", &fixed).await.unwrap();
    assert_eq!(outcome, Outcome::Processed(Some(1)));
    db.cleanup().await;
}

/// Runs `effect` on `payment` and checks that it is refused as invalid, with neither a key
/// nor an effect written.
async fn refused_before_anything_is_written<DB: TestBackend>(
    db: &TestDb<DB>,
    payment: &justonce_sql::Key,
    effect: &Effect<DB>,
) {
    let error = db
        .inbox
        .run_effect(payment, b"p", effect)
        .await
        .unwrap_err();
    assert!(matches!(error, Error::InvalidStatement(_)), "{error:?}");
    assert_eq!((db.rows("keys").await, db.rows("effects").await), (0, 0));
}

/// Without `claimed` the statement would run for duplicates too: it is refused before
/// anything is written, whatever the text holds that looks like it.
async fn a_statement_without_claimed_is_refused_before_it_is_sent<DB: TestBackend>(test: &str)
where
    for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
{
    let db = TestDb::<DB>::new(test).await;
    let payment = key("payment:5");
    let [first, _] = DB::PARAMETERS;
    let prefix = &db.prefix;
    let blind = Effect::<DB>::new(format!(
        "INSERT INTO {prefix}effects (consumer, msg_key) VALUES ('claimed', {first}) -- claimed"
    ))
    .bind(Some(payment.as_str().to_owned()));
    refused_before_anything_is_written(&db, &payment, &blind).await;
    db.cleanup().await;
}

/// A statement that names `claimed` as a column and as an alias, but reads no relation of
/// that name, would run for duplicates too: refused, nothing written.
async fn claimed_as_a_column_or_an_alias_is_refused_before_it_is_sent<DB: TestBackend>(test: &str)
where
    for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
{
    let db = TestDb::<DB>::new(test).await;
    let payment = key("payment:6");
    let [first, _] = DB::PARAMETERS;
    let prefix = &db.prefix;
    let blind = Effect::<DB>::new(format!(
        "INSERT INTO {prefix}effects (consumer, msg_key) \
         SELECT claimed, {first} FROM (SELECT 'x' AS claimed) AS t"
    ))
    .bind(Some(payment.as_str().to_owned()));
    refused_before_anything_is_written(&db, &payment, &blind).await;
    db.cleanup().await;
}

/// A statement that reads `claimed` yet writes without it: written once all the same. On
/// PostgreSQL the duplicate's one statement fails and is refused as invalid; elsewhere the
/// duplicate never runs it.
async fn an_effect_that_writes_without_a_claim_writes_once<DB: TestBackend>(test: &str)
where
    for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
{
    let db = TestDb::<DB>::new(test).await;
    let payment = key("payment:7");
    let [first, second] = DB::PARAMETERS;
    let prefix = &db.prefix;
    let careless = Effect::<DB>::new(format!(
        "INSERT INTO {prefix}effects (consumer, msg_key) \
         SELECT {first}, {second} FROM (SELECT 1 AS one) AS t \
         WHERE EXISTS (SELECT 1 FROM claimed) OR t.one = 1"
    ))
    .bind(Some("test".to_owned()))
    .bind(Some(payment.as_str().to_owned()));
    let first_run = db.inbox.run_effect(&payment, b"p", &careless).await;
    assert_eq!(first_run.unwrap(), Outcome::Processed(Some(1)));
    let other = TestDb::<DB>::reopen(&db.url, &db.prefix).await;
    let again = other.inbox.run_effect(&payment, b"p", &careless).await;
    if <DB as sqlx::Database>::NAME == "PostgreSQL" {
        assert!(
            matches!(again, Err(Error::InvalidStatement(_))),
            "{again:?}"
        );
    } else {
        assert_eq!(again.unwrap(), Outcome::Duplicate);
    }
    assert_eq!(
        (db.rows("keys").await, db.effects_of(&payment).await),
        (1, 1)
    );
    db.cleanup().await;
}

/// `claimed c` and `claimed AS c` read the one column `justonce_claimed` through the alias,
/// on every database.
async fn claimed_takes_an_alias<DB: TestBackend>(test: &str)
where
    for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
{
    let db = TestDb::<DB>::new(test).await;
    let [first, second] = DB::PARAMETERS;
    let prefix = &db.prefix;
    let statements = [
        format!(
            "INSERT INTO {prefix}effects (consumer, msg_key) \
             SELECT {first}, {second} FROM claimed c WHERE c.justonce_claimed = 1"
        ),
        format!(
            "INSERT INTO {prefix}effects (consumer, msg_key) \
             SELECT {first}, {second} FROM (SELECT 1 AS one) AS t \
             JOIN claimed AS c ON c.justonce_claimed = t.one"
        ),
    ];
    for (place, sql) in statements.into_iter().enumerate() {
        let payment = key(&format!("payment:alias:{place}"));
        let effect = Effect::<DB>::new(sql)
            .bind(Some("test".to_owned()))
            .bind(Some(payment.as_str().to_owned()));
        let outcome = db.inbox.run_effect(&payment, b"p", &effect).await;
        assert_eq!(outcome.unwrap(), Outcome::Processed(Some(1)));
        let again = db.inbox.run_effect(&payment, b"p", &effect).await;
        assert_eq!(again.unwrap(), Outcome::Duplicate);
        assert_eq!(db.effects_of(&payment).await, 1);
    }
    db.cleanup().await;
}

/// `X; Y` would run `Y` for duplicates too: refused, nothing written.
async fn two_statements_are_refused_before_they_are_sent<DB: TestBackend>(test: &str)
where
    for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
{
    let db = TestDb::<DB>::new(test).await;
    let payment = key("payment:8");
    let prefix = &db.prefix;
    let two = Effect::<DB>::new(format!(
        "INSERT INTO {prefix}effects (consumer, msg_key) SELECT 'a', 'b' FROM claimed; \
         INSERT INTO {prefix}effects (consumer, msg_key) VALUES ('c', 'd');"
    ));
    refused_before_anything_is_written(&db, &payment, &two).await;
    db.cleanup().await;
}

/// A nested comment hides `FROM claimed` from PostgreSQL but not from the check: the
/// statement's own guard refuses the duplicate's run, and the effect stays one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_refuses_a_duplicate_the_check_let_through() {
    let db = TestDb::<Postgres>::new("postgres_refuses_a_duplicate_the_check_let_through").await;
    let payment = key("payment:9");
    let prefix = &db.prefix;
    let hidden = Effect::<Postgres>::new(format!(
        "INSERT INTO {prefix}effects (consumer, msg_key) SELECT $1, $2 /* /* */ FROM claimed */"
    ))
    .bind("test")
    .bind(payment.as_str());
    let first = db.inbox.run_effect(&payment, b"p", &hidden).await;
    assert_eq!(first.unwrap(), Outcome::Processed(Some(1)));
    let other = TestDb::<Postgres>::reopen(&db.url, &db.prefix).await;
    let again = other.inbox.run_effect(&payment, b"p", &hidden).await;
    assert!(
        matches!(again, Err(Error::InvalidStatement(_))),
        "{again:?}"
    );
    assert_eq!(
        (db.rows("keys").await, db.effects_of(&payment).await),
        (1, 1)
    );
    db.cleanup().await;
}

/// A serialization failure of the one statement sends the effect to a transaction, where
/// `claimed` is a derived row: an alias and its column work there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_retry_path_takes_an_alias() {
    let db = TestDb::<Postgres>::new("postgres_retry_path_takes_an_alias").await;
    let prefix = &db.prefix;
    // Fails its first call only: a sequence is not rolled back with the statement.
    let setup = format!(
        "CREATE SEQUENCE {prefix}calls;
         CREATE FUNCTION {prefix}fail_once() RETURNS boolean LANGUAGE plpgsql AS $f$
         BEGIN
             IF nextval('{prefix}calls') = 1 THEN
                 RAISE EXCEPTION 'first call' USING ERRCODE = '40001';
             END IF;
             RETURN true;
         END $f$"
    );
    Postgres::execute(db.inbox.pool(), setup).await.unwrap();
    let payment = key("payment:10");
    let effect = Effect::<Postgres>::new(format!(
        "INSERT INTO {prefix}effects (consumer, msg_key) \
         SELECT $1, $2 FROM claimed AS c WHERE c.justonce_claimed = 1 AND {prefix}fail_once()"
    ))
    .bind("test")
    .bind(payment.as_str());
    let outcome = db.inbox.run_effect(&payment, b"p", &effect).await;
    assert_eq!(outcome.unwrap(), Outcome::Processed(Some(1)));
    let calls = Postgres::texts(
        db.inbox.pool(),
        format!("SELECT last_value::text FROM {prefix}calls"),
    )
    .await
    .unwrap();
    // The one statement failed, the transaction ran it.
    assert_eq!(calls, ["2"]);
    assert_eq!(db.effects_of(&payment).await, 1);
    Postgres::execute(
        db.inbox.pool(),
        format!("DROP FUNCTION {prefix}fail_once(); DROP SEQUENCE {prefix}calls"),
    )
    .await
    .unwrap();
    db.cleanup().await;
}
