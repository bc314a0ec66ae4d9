//! The fault harness, run as CI runs it: the short version of each scenario through the
//! real binary must find nothing lost, doubled or unexpected and exit 0, and the same
//! harness against a deliberately broken worker must report violations and exit 1.

use serde_json::Value;
use std::time::Duration;
use tokio::process::Command;

/// Runs `fault-harness --short --json` with `args`; its exit code and the figures it printed.
async fn harness(args: &[&str]) -> (i32, Value) {
    let output = Command::new(env!("CARGO_BIN_EXE_fault-harness"))
        .args(["--short", "--json"])
        .args(args)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(300), output)
        .await
        .expect("fault-harness hung")
        .expect("run fault-harness");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let figures = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "fault-harness {args:?} printed no figures ({e}): {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output.status.code().expect("an exit code"), figures)
}

/// Asserts a clean run: every key attempted and acknowledged, none lost, doubled or
/// unexpected, exit 0.
fn assert_clean(args: &[&str], (code, figures): &(i32, Value)) {
    let count = |name: &str| figures[name].as_u64().expect(name);
    assert_eq!(
        (count("lost"), count("duplicated"), count("unexpected")),
        (0, 0, 0),
        "{args:?}: {figures}"
    );
    assert_eq!(count("attempted"), count("keys"), "{args:?}: {figures}");
    assert_eq!(count("acknowledged"), count("keys"), "{args:?}: {figures}");
    assert_eq!(*code, 0, "{args:?}: {figures}");
}

async fn killed_worker_on(backend: &str) {
    let args = ["--scenario", "kill", "--backend", backend];
    let run = harness(&args).await;
    assert_clean(&args, &run);
    assert_eq!(run.1["faults"], 20, "{}", run.1);
    // Every fourth kill finds a key committed and not yet acknowledged: it comes again.
    assert_eq!(
        run.1["details"]["kills at the failpoint (committed-not-acknowledged)"], 5,
        "{}",
        run.1
    );
    assert!(run.1["redeliveries"].as_u64().unwrap() > 0, "{}", run.1);
    assert!(
        run.1["details"]["acknowledged as duplicates"]
            .as_u64()
            .unwrap()
            >= 5,
        "each key paused at the failpoint is acknowledged as a duplicate when it comes again: {}",
        run.1
    );
}

#[tokio::test]
async fn a_worker_killed_twenty_times_loses_and_doubles_nothing_on_postgres() {
    killed_worker_on("postgres").await
}

#[tokio::test]
async fn a_worker_killed_twenty_times_loses_and_doubles_nothing_on_mysql() {
    killed_worker_on("mysql").await
}

#[tokio::test]
async fn a_worker_killed_twenty_times_loses_and_doubles_nothing_on_sqlite() {
    killed_worker_on("sqlite").await
}

async fn killed_consumer_on(broker: &str) {
    killed_consumer_taking(&["--scenario", "broker-kill", "--broker", broker]).await
}

/// broker-kill with `args`, as [`killed_consumer_on`] checks it.
async fn killed_consumer_taking(args: &[&str]) {
    let broker = args[3];
    let run = harness(args).await;
    assert_clean(args, &run);
    let figures = &run.1;
    assert_eq!(figures["faults"], 10, "{figures}");
    assert_eq!(
        figures["details"]["kills at the failpoint (committed-not-acknowledged)"], 2,
        "{figures}"
    );
    // Each kill is followed by an effect of the new consumer's.
    assert!(figures["recovery_max_ms"].as_u64().is_some(), "{figures}");
    if broker == "nats" {
        // The consumer held messages when it was killed: JetStream delivered them again.
        assert!(figures["redeliveries"].as_u64().unwrap() > 0, "{figures}");
    } else {
        // The broker cannot say how often it delivered again (a single reader is not
        // delivered again: it reads on from its stored position), and the table says so.
        assert!(figures["redeliveries"].is_null(), "{figures}");
    }
}

#[tokio::test]
async fn a_rabbitmq_consumer_killed_ten_times_loses_and_doubles_nothing() {
    killed_consumer_on("amqp").await
}

#[tokio::test]
async fn a_redis_streams_consumer_killed_ten_times_loses_and_doubles_nothing() {
    killed_consumer_on("redis").await
}

#[tokio::test]
async fn a_nats_jetstream_consumer_killed_ten_times_loses_and_doubles_nothing() {
    killed_consumer_on("nats").await
}

#[tokio::test]
async fn an_mqtt_consumer_killed_ten_times_loses_and_doubles_nothing() {
    killed_consumer_on("mqtt").await
}

/// A batch committing while the one before is acknowledged: a kill between the two loses
/// and doubles nothing.
#[tokio::test]
async fn a_batched_rabbitmq_consumer_killed_ten_times_loses_and_doubles_nothing() {
    killed_consumer_taking(&["--scenario", "broker-kill", "--broker", "amqp", "--batched"]).await
}

#[tokio::test]
async fn a_batched_nats_jetstream_consumer_killed_ten_times_loses_and_doubles_nothing() {
    killed_consumer_taking(&["--scenario", "broker-kill", "--broker", "nats", "--batched"]).await
}

#[tokio::test]
async fn a_redis_streams_reader_killed_ten_times_loses_and_doubles_nothing() {
    killed_consumer_on("redis-reader").await
}

#[tokio::test]
async fn a_nats_jetstream_reader_killed_ten_times_loses_and_doubles_nothing() {
    killed_consumer_on("nats-reader").await
}

/// broker-restart through `broker`: a broker of the harness's own killed twice under load
/// loses and doubles nothing it confirmed, and the consumer, never started again, is
/// consuming again after each: it connected again by itself.
async fn restarted_broker(broker: &str) {
    let args = ["--scenario", "broker-restart", "--broker", broker];
    let run = harness(&args).await;
    assert_clean(&args, &run);
    let figures = &run.1;
    assert_eq!(figures["faults"], 2, "{figures}");
    assert_eq!(figures["drained"], true, "{figures}");
    assert_eq!(
        figures["details"]["consumer processes started again after exiting"], 0,
        "{figures}"
    );
    // Each restart is followed by an effect committed through the broker that came back: a
    // consumer that hangs instead is a breach, which `assert_clean` refuses.
    assert!(figures["recovery_max_ms"].as_u64().is_some(), "{figures}");
}

#[tokio::test]
async fn a_rabbitmq_node_killed_twice_under_load_loses_and_doubles_nothing_confirmed() {
    restarted_broker("amqp").await
}

#[tokio::test]
async fn a_nats_server_killed_twice_under_load_loses_and_doubles_nothing_confirmed() {
    restarted_broker("nats").await
}

#[tokio::test]
async fn a_redis_server_killed_twice_under_load_loses_and_doubles_nothing_confirmed() {
    restarted_broker("redis").await
}

#[tokio::test]
async fn a_mosquitto_killed_twice_under_load_loses_and_doubles_nothing_confirmed() {
    restarted_broker("mqtt").await
}

/// pause through `broker`: a consumer that stops itself holding a delivery it has not run,
/// past the broker's wait, loses the delivery to the other; resumed, it runs it late, as a
/// duplicate, and no effect doubles.
async fn paused_consumer(broker: &str) {
    let args = ["--scenario", "pause", "--broker", broker];
    let run = harness(&args).await;
    assert_clean(&args, &run);
    let figures = &run.1;
    assert_eq!(figures["faults"], 2, "{figures}");
    assert_eq!(figures["drained"], true, "{figures}");
    let detail = |name: &str| figures["details"][name].as_u64().expect(name);
    // Each key is published once: every duplicate is a delivery the broker made again,
    // and the keys were processed once between the two consumers.
    assert_eq!(
        detail("paused consumer: acknowledged as processed")
            + detail("other consumer: acknowledged as processed"),
        1_000,
        "{figures}"
    );
    // The harness resumes it only once the other committed what it held.
    assert!(
        detail("paused consumer: acknowledged as duplicates") >= 2,
        "each paused delivery, run late, is a duplicate: {figures}"
    );
}

#[tokio::test]
async fn a_nats_jetstream_consumer_paused_past_its_ack_wait_doubles_nothing() {
    paused_consumer("nats").await
}

#[tokio::test]
async fn a_redis_streams_consumer_paused_past_claim_idle_doubles_nothing() {
    paused_consumer("redis").await
}

#[tokio::test]
async fn a_kafka_member_paused_past_its_session_timeout_doubles_nothing() {
    paused_consumer("kafka").await
}

/// group-kill: two Kafka members on four partitions, one SIGKILLed five times while it
/// consumes and the other taking its partitions: every key once, and every partition's
/// stored offset at its last record.
#[tokio::test]
async fn a_kafka_member_killed_five_times_while_the_other_takes_its_partitions_loses_and_doubles_nothing()
 {
    let args = ["--scenario", "group-kill"];
    let run = harness(&args).await;
    assert_clean(&args, &run);
    let figures = &run.1;
    assert_eq!(figures["keys"], 8_000, "{figures}");
    assert_eq!(figures["deliveries"], 10_000, "{figures}");
    assert_eq!(figures["faults"], 5, "{figures}");
    assert_eq!(figures["drained"], true, "{figures}");
    // Each kill was followed by the other member reading on in every partition.
    assert!(figures["recovery_max_ms"].as_u64().is_some(), "{figures}");
    assert_eq!(
        figures["details"]["partitions whose stored offset is their last record's"], 4,
        "{figures}"
    );
}

/// group-kill with members that rely on the broker's auto-committed offsets: the offsets
/// of records taken are committed before their effects, and a kill loses those.
#[tokio::test]
async fn the_check_reports_losses_when_kafka_members_rely_on_auto_committed_offsets() {
    let (code, figures) = harness(&["--scenario", "group-kill", "--broken", "auto-commit"]).await;
    assert!(figures["lost"].as_u64().unwrap() > 0, "{figures}");
    assert_eq!(code, 1, "{figures}");
}

#[tokio::test]
async fn the_check_reports_losses_when_acknowledging_before_commit() {
    let (code, figures) = harness(&["--scenario", "kill", "--broken", "ack-before-commit"]).await;
    assert!(figures["lost"].as_u64().unwrap() > 0, "{figures}");
    assert_eq!(code, 1, "{figures}");
}

/// broker-kill through `broker` with the broken consumer `mode`: the harness must count
/// some keys under `violation` and exit 1.
async fn broken_consumer_caught(broker: &str, mode: &str, violation: &str) {
    let args = [
        "--scenario",
        "broker-kill",
        "--broker",
        broker,
        "--broken",
        mode,
    ];
    let (code, figures) = harness(&args).await;
    assert!(figures[violation].as_u64().unwrap() > 0, "{figures}");
    assert_eq!(code, 1, "{figures}");
}

async fn losses_when_a_consumer_acknowledges_before_commit_on(broker: &str) {
    broken_consumer_caught(broker, "ack-before-commit", "lost").await
}

#[tokio::test]
async fn the_check_reports_losses_when_a_rabbitmq_consumer_acknowledges_before_commit() {
    losses_when_a_consumer_acknowledges_before_commit_on("amqp").await
}

#[tokio::test]
async fn the_check_reports_losses_when_a_redis_streams_consumer_acknowledges_before_commit() {
    losses_when_a_consumer_acknowledges_before_commit_on("redis").await
}

#[tokio::test]
async fn the_check_reports_losses_when_a_nats_jetstream_consumer_acknowledges_before_commit() {
    losses_when_a_consumer_acknowledges_before_commit_on("nats").await
}

#[tokio::test]
async fn the_check_reports_losses_when_an_mqtt_consumer_acknowledges_before_commit() {
    losses_when_a_consumer_acknowledges_before_commit_on("mqtt").await
}

async fn doubles_when_a_reader_claims_apart_from_its_effect_on(broker: &str) {
    broken_consumer_caught(broker, "separate-claim", "duplicated").await
}

#[tokio::test]
async fn the_check_reports_doubles_when_a_redis_streams_reader_claims_apart_from_its_effect() {
    doubles_when_a_reader_claims_apart_from_its_effect_on("redis-reader").await
}

#[tokio::test]
async fn the_check_reports_doubles_when_a_nats_jetstream_reader_claims_apart_from_its_effect() {
    doubles_when_a_reader_claims_apart_from_its_effect_on("nats-reader").await
}

#[tokio::test]
async fn the_check_reports_doubles_when_claiming_in_a_separate_transaction() {
    let (code, figures) = harness(&["--scenario", "kill", "--broken", "separate-claim"]).await;
    assert!(figures["duplicated"].as_u64().unwrap() > 0, "{figures}");
    assert_eq!(code, 1, "{figures}");
}

/// A run without faults: clean, and each key acknowledged as processed exactly once.
async fn clean_run(scenario: &str, backend: &str) {
    let args = ["--scenario", scenario, "--backend", backend];
    let run = harness(&args).await;
    assert_clean(&args, &run);
    let figures = &run.1;
    assert_eq!(
        figures["details"]["acknowledged as processed"], figures["keys"],
        "{figures}"
    );
}

#[tokio::test]
async fn a_storm_of_ten_deliveries_per_key_takes_effect_once_per_key_on_postgres() {
    clean_run("storm", "postgres").await
}

#[tokio::test]
async fn a_storm_of_ten_deliveries_per_key_takes_effect_once_per_key_on_mysql() {
    clean_run("storm", "mysql").await
}

#[tokio::test]
async fn sixty_four_consumers_on_the_same_keys_take_effect_once_per_key_on_postgres() {
    clean_run("hot-keys", "postgres").await
}

#[tokio::test]
async fn sixty_four_consumers_on_the_same_keys_take_effect_once_per_key_on_mysql() {
    clean_run("hot-keys", "mysql").await
}

#[tokio::test]
async fn sixty_four_consumers_on_the_same_keys_take_effect_once_per_key_on_sqlite() {
    clean_run("hot-keys", "sqlite").await
}

#[tokio::test]
async fn a_commit_whose_answer_is_cut_is_resolved_by_reading_the_key_on_postgres() {
    commit_cut_on("postgres").await
}

#[tokio::test]
async fn a_commit_whose_answer_is_cut_is_resolved_by_reading_the_key_on_mysql() {
    commit_cut_on("mysql").await
}

/// Every cut resolved by reading the key, and never acknowledged while unknown.
async fn commit_cut_on(backend: &str) {
    let args = ["--scenario", "commit-cut", "--backend", backend];
    let run = harness(&args).await;
    assert_clean(&args, &run);
    let details = &run.1["details"];
    let count = |name: &str| details[name].as_u64().expect(name);
    assert_eq!(
        count("cuts after COMMIT was forwarded") + count("cuts before COMMIT was forwarded"),
        30,
        "{details}"
    );
    assert!(
        count("  resolved by reading the key: processed, work not run again") > 0,
        "{details}"
    );
    // An outage outlasts the resolution: the commit is unknown, and the key not acknowledged.
    assert!(count("refused (commit-unknown)") > 0, "{details}");
    assert_eq!(
        (
            count("cuts resolved otherwise"),
            count("cuts whose key was not seen")
        ),
        (0, 0),
        "{details}"
    );
}

#[tokio::test]
async fn postgres_stopped_immediately_during_the_run_loses_and_doubles_nothing() {
    let args = ["--scenario", "pg-immediate", "--backend", "postgres"];
    let run = harness(&args).await;
    assert_clean(&args, &run);
    assert_eq!(run.1["faults"], 2, "{}", run.1);
    assert!(run.1["recovery_max_ms"].as_u64().is_some(), "{}", run.1);
}

async fn killed_relay_on(backend: &str) {
    let args = ["--scenario", "relay-kill", "--backend", backend];
    let run = harness(&args).await;
    assert_clean(&args, &run);
    let figures = &run.1;
    assert_eq!(figures["faults"], 10, "{figures}");
    // A kill at the failpoint leaves a row the receiver accepted unmarked: it goes again.
    assert!(
        figures["details"]["kills at the failpoint (accepted, not yet marked sent)"]
            .as_u64()
            .unwrap()
            > 0,
        "{figures}"
    );
    assert!(figures["redeliveries"].as_u64().unwrap() > 0, "{figures}");
    assert_eq!(
        figures["details"]["rows left unsent or dead"], 0,
        "{figures}"
    );
}

#[tokio::test]
async fn a_relay_killed_ten_times_delivers_every_row_with_one_key_on_postgres() {
    killed_relay_on("postgres").await
}

#[tokio::test]
async fn a_relay_killed_ten_times_delivers_every_row_with_one_key_on_mysql() {
    killed_relay_on("mysql").await
}

#[tokio::test]
async fn a_relay_killed_ten_times_delivers_every_row_with_one_key_on_sqlite() {
    killed_relay_on("sqlite").await
}

#[tokio::test]
async fn the_check_reports_doubles_when_the_relay_sends_a_new_key_per_try() {
    let (code, figures) = harness(&["--scenario", "relay-kill", "--broken", "key-per-try"]).await;
    // Every try keyed otherwise than its row, and a row sent again with a second key.
    assert!(
        figures["unexpected"].as_u64().unwrap() >= figures["keys"].as_u64().unwrap(),
        "{figures}"
    );
    assert!(figures["duplicated"].as_u64().unwrap() > 0, "{figures}");
    assert_eq!(code, 1, "{figures}");
}

async fn killed_server_on(backend: &str) {
    let args = ["--scenario", "serve-kill", "--backend", backend];
    let run = harness(&args).await;
    assert_clean(&args, &run);
    let figures = &run.1;
    assert_eq!(figures["faults"], 10, "{figures}");
    assert_eq!(
        figures["details"]["kills at the failpoint (stored-not-answered)"], 2,
        "{figures}"
    );
    let answers = |status: &str| {
        figures["details"][format!("answered 200 {status}")]
            .as_u64()
            .unwrap_or(0)
    };
    // Each send ends with a 2xx: as new at most once per event, as a duplicate for each copy
    // sent after a 2xx, and for a retry whose first answer was lost in a kill.
    assert_eq!(
        answers("accepted") + answers("duplicate"),
        figures["deliveries"].as_u64().unwrap(),
        "{figures}"
    );
    assert!(answers("accepted") <= 1_000, "{figures}");
    assert!(answers("duplicate") >= 100, "{figures}");
}

#[tokio::test]
async fn a_server_killed_ten_times_acts_once_on_every_acknowledged_webhook_on_postgres() {
    killed_server_on("postgres").await
}

#[tokio::test]
async fn a_server_killed_ten_times_acts_once_on_every_acknowledged_webhook_on_mysql() {
    killed_server_on("mysql").await
}

#[tokio::test]
async fn a_server_killed_ten_times_acts_once_on_every_acknowledged_webhook_on_sqlite() {
    killed_server_on("sqlite").await
}

#[tokio::test]
async fn the_check_reports_losses_when_the_server_answers_before_it_stores() {
    let (code, figures) = harness(&[
        "--scenario",
        "serve-kill",
        "--broken",
        "answer-before-store",
    ])
    .await;
    assert!(figures["lost"].as_u64().unwrap() > 0, "{figures}");
    assert_eq!(code, 1, "{figures}");
}

async fn slow_clients_on(backend: &str) {
    let args = ["--scenario", "slow-clients", "--backend", backend];
    let run = harness(&args).await;
    assert_clean(&args, &run);
    let figures = &run.1;
    let detail = |name: &str| figures["details"][name].as_u64().expect(name);
    // More hostile clients came as the first 200 were closed, and the server closed every
    // one after its 2 s header timeout (the harness exits 1 when one is held 10 s).
    assert!(detail("hostile connections opened") > 200, "{figures}");
    assert_eq!(
        detail("hostile connections closed by the server"),
        detail("hostile connections opened"),
        "{figures}"
    );
    assert!(detail("slowest close (ms)") >= 2_000, "{figures}");
    // Meanwhile the honest senders were answered, most of them at once: a server held up
    // by the hostile clients would answer them after its header timeout, if ever.
    assert!(detail("honest latency p50 (ms)") < 1_000, "{figures}");
}

#[tokio::test]
async fn hostile_clients_holding_connections_leave_every_webhook_answered_once_on_postgres() {
    slow_clients_on("postgres").await
}

#[tokio::test]
async fn hostile_clients_holding_connections_leave_every_webhook_answered_once_on_mysql() {
    slow_clients_on("mysql").await
}

#[tokio::test]
async fn hostile_clients_holding_connections_leave_every_webhook_answered_once_on_sqlite() {
    slow_clients_on("sqlite").await
}

async fn slow_target_on(backend: &str) {
    let args = ["--scenario", "slow-target", "--backend", backend];
    let run = harness(&args).await;
    assert_clean(&args, &run);
    let figures = &run.1;
    let detail = |name: &str| figures["details"][name].as_u64().expect(name);
    // The healthy target's deliveries never waited as long as the slow one's timeout (10
    // s); they arrive within a second or so of their 2xx.
    assert!(
        detail("healthy target: from 2xx to arrival max (ms)") < 10_000,
        "{figures}"
    );
    // The slow target's breaker paused it, and once it answered again every one of its
    // events reached it.
    assert!(detail("slow target: breaker pauses") >= 1, "{figures}");
    assert_eq!(
        detail("slow target: events that reached it after it turned healthy"),
        100,
        "{figures}"
    );
}

#[tokio::test]
async fn a_target_that_does_not_answer_holds_back_no_other_and_gets_every_event_once_on_postgres() {
    slow_target_on("postgres").await
}

#[tokio::test]
async fn a_target_that_does_not_answer_holds_back_no_other_and_gets_every_event_once_on_mysql() {
    slow_target_on("mysql").await
}

#[tokio::test]
async fn a_target_that_does_not_answer_holds_back_no_other_and_gets_every_event_once_on_sqlite() {
    slow_target_on("sqlite").await
}
