//! `justonce events`: the events each source and consumer stored; `justonce replay`: deliver
//! them again with the same key.

use super::deliveries::print_attempts;
use super::output::{
    attempt_json, bytes_json, counted, one_line, print_table, scope_or_none, utc_text,
};
use crate::cli::{EventListArgs, EventsCommand, OriginArgs, ReplayArgs};
use crate::config::Settings;
use anyhow::{Context, Result};
use justonce_cli_support::Usage;
use justonce_sql::{
    Backend, Event, EventDetail, EventFilter, EventPage, Outbox, ReplayRange, ReplayWindow,
};
use serde_json::{Value, json};

/// Runs one `events` command on the outbox.
pub async fn run<DB: Backend>(
    settings: &Settings,
    outbox: &Outbox<DB>,
    command: EventsCommand,
) -> Result<()> {
    match command {
        EventsCommand::List(args) => {
            let page = outbox.events(&event_filter(settings, &args)?).await?;
            if args.json {
                println!("{}", page_json(&page));
            } else {
                print_page(&page);
            }
        }
        EventsCommand::Show {
            id: Some(id), json, ..
        } => {
            let event = outbox
                .event(id)
                .await?
                .with_context(|| format!("no event has id {id}"))?;
            if json {
                println!("{}", detail_json(&event));
            } else {
                print_detail(&event);
            }
        }
        EventsCommand::Show {
            key: Some(key),
            json,
            ..
        } => {
            let events = outbox.events_with_key(&key).await?;
            if events.is_empty() {
                anyhow::bail!("no event has key {key}");
            }
            if json {
                println!("{}", Value::from_iter(events.iter().map(detail_json)));
                return Ok(());
            }
            for (index, event) in events.iter().enumerate() {
                if index > 0 {
                    println!();
                }
                print_detail(event);
            }
        }
        EventsCommand::Show { .. } => {
            return Err(Usage("give an event's id, or --key".to_owned()).into());
        }
    }
    Ok(())
}

/// Runs `replay`: says what it would put back, or with `--yes` puts it back.
pub async fn replay<DB: Backend>(
    settings: &Settings,
    outbox: &Outbox<DB>,
    args: ReplayArgs,
) -> Result<()> {
    let origin = origin_of(settings, &args.origin)?;
    match (args.id, args.key, origin, args.since) {
        (Some(id), ..) => replay_one(outbox, id, args.yes).await,
        (None, Some(key), ..) => replay_key(outbox, &key, args.yes).await,
        (None, None, Some(origin), Some(since)) => {
            let mut range = ReplayRange::new(origin, since);
            if let Some(until) = args.until {
                range = range.until(until);
            }
            replay_range(outbox, &range, args.yes).await
        }
        (None, None, Some(_), None) => Err(Usage(
            "a replay of a source or consumer needs --since: the start of its time range"
                .to_owned(),
        )
        .into()),
        (None, None, None, _) => Err(Usage(
            "give an event's id, --key, or --source or --consumer with --since".to_owned(),
        )
        .into()),
    }
}

async fn replay_one<DB: Backend>(outbox: &Outbox<DB>, id: i64, yes: bool) -> Result<()> {
    let shown = outbox
        .event(id)
        .await?
        .with_context(|| format!("no event has id {id}"))?;
    let event = &shown.event;
    if event.state == justonce_sql::EventState::Due {
        anyhow::bail!("event {id} ({}) waits for its delivery already", event.key);
    }
    if !yes {
        println!(
            "would replay event {id} of {} ({}, {}): its target receives it again with \
             Idempotency-Key {}; pass --yes to replay it",
            event.origin, event.key, event.state, event.key
        );
        return Ok(());
    }
    if !outbox.replay_event(id).await? {
        anyhow::bail!("event {id} ({}) waits for its delivery already", event.key);
    }
    println!("event {id} ({}) is due again", event.key);
    Ok(())
}

async fn replay_key<DB: Backend>(outbox: &Outbox<DB>, key: &str, yes: bool) -> Result<()> {
    let events = outbox.events_with_key(key).await?;
    if events.is_empty() {
        anyhow::bail!("no event has key {key}");
    }
    let waiting = events
        .iter()
        .filter(|e| e.event.state == justonce_sql::EventState::Due)
        .count();
    let replayable = events.len() - waiting;
    if !yes {
        println!(
            "would replay {} with key {key} ({waiting} waiting for a delivery already); \
             pass --yes to replay",
            counted(replayable, "event", "events")
        );
        return Ok(());
    }
    let replayed = outbox.replay_key(key).await?;
    println!(
        "{} with key {key} due again",
        counted(replayed, "event", "events")
    );
    Ok(())
}

async fn replay_range<DB: Backend>(
    outbox: &Outbox<DB>,
    range: &ReplayRange,
    yes: bool,
) -> Result<()> {
    if !yes {
        let events = outbox.replayable(range).await?;
        println!(
            "would replay {} delivered or dead; pass --yes to replay",
            counted(events, "event", "events")
        );
        return Ok(());
    }
    let window = outbox.replay_range(range).await?;
    print_window(&window);
    Ok(())
}

fn print_window(window: &ReplayWindow) {
    println!(
        "replay {}: {} of {} received from {} to {} due again",
        window.id,
        counted(window.events, "event", "events"),
        window.origin,
        utc_text(window.since),
        utc_text(window.until)
    );
}

/// The source's or consumer's name, checked against the settings so that a misspelt one
/// is said, not listed as empty.
fn origin_of(settings: &Settings, args: &OriginArgs) -> Result<Option<String>> {
    if let Some(source) = &args.source
        && !settings.sources.iter().any(|s| &s.name == source)
    {
        return Err(Usage(format!("no source is named {source:?}")).into());
    }
    if let Some(consumer) = &args.consumer
        && !settings.consumers.iter().any(|c| &c.name == consumer)
    {
        return Err(Usage(format!("no consumer is named {consumer:?}")).into());
    }
    Ok(args.source.clone().or_else(|| args.consumer.clone()))
}

fn event_filter(settings: &Settings, args: &EventListArgs) -> Result<EventFilter> {
    let mut filter = EventFilter::default().limit(args.limit);
    if let Some(origin) = origin_of(settings, &args.origin)? {
        filter = filter.origin(origin);
    }
    if let Some(part) = &args.key {
        filter = filter.key_contains(part);
    }
    if let Some(prefix) = &args.key_prefix {
        filter = filter.key_prefix(prefix);
    }
    if let Some(since) = args.since {
        filter = filter.since(since);
    }
    if let Some(until) = args.until {
        filter = filter.until(until);
    }
    if let Some(state) = &args.state {
        filter = filter.state(state.parse().map_err(Usage)?);
    }
    if let Some(cursor) = &args.cursor {
        filter = filter
            .after(cursor)
            .map_err(|error| Usage(format!("--cursor: {error}")))?;
    }
    Ok(filter)
}

fn print_page(page: &EventPage) {
    print_table(
        "events",
        &[
            "id",
            "origin",
            "key",
            "state",
            "received",
            "attempts",
            "last error",
        ],
        page.events.iter().map(|event| {
            vec![
                event.id.to_string(),
                event.origin.clone(),
                event.key.clone(),
                event.state.to_string(),
                utc_text(event.received_at),
                event.attempts.to_string(),
                one_line(event.last_error.as_deref().unwrap_or_default()),
            ]
        }),
    );
    if let Some(since) = page.searched_since {
        println!(
            "--key searched the events received from {}: --since searches further back",
            utc_text(since)
        );
    }
    if let Some(cursor) = &page.next {
        println!("more: --cursor {cursor}");
    }
}

fn event_json(event: &Event) -> Value {
    json!({
        "id": event.id,
        "scope": (!event.scope.is_empty()).then_some(&event.scope),
        "key": event.key,
        "origin": event.origin,
        "received_at": utc_text(event.received_at),
        "state": event.state.as_str(),
        "attempts": event.attempts,
        "last_error": event.last_error,
    })
}

/// A page of events as JSON, as `events list --json` prints it and the admin API answers it.
pub fn page_json(page: &EventPage) -> Value {
    json!({
        "events": Value::from_iter(page.events.iter().map(event_json)),
        "next_cursor": page.next,
        "searched_since": page.searched_since.map(utc_text),
    })
}

/// An event with its body and attempts as JSON, as `events show --json` prints it and the
/// admin API answers it.
pub fn detail_json(shown: &EventDetail) -> Value {
    let mut object = event_json(&shown.event);
    object["headers"] = Value::from_iter(
        shown
            .headers
            .iter()
            .map(|(name, value)| json!([name, value])),
    );
    bytes_json(&mut object, "body", &shown.payload);
    object["deliveries"] = Value::from_iter(shown.attempts.iter().map(attempt_json));
    object
}

/// Prints an event: what it is and where it is, its headers, its attempts, then its body.
fn print_detail(shown: &EventDetail) {
    let event = &shown.event;
    println!("id:          {}", event.id);
    println!("origin:      {}", event.origin);
    println!("key:         {}", event.key);
    println!("scope:       {}", scope_or_none(&event.scope));
    println!("received:    {}", utc_text(event.received_at));
    println!(
        "state:       {} after {}",
        event.state,
        counted(event.attempts, "attempt", "attempts")
    );
    if let Some(error) = &event.last_error {
        println!("last error:  {error}");
    }
    for (name, value) in &shown.headers {
        println!("header:      {name}: {value}");
    }
    println!();
    print_attempts(&shown.attempts);
    println!("{}", String::from_utf8_lossy(&shown.payload));
}
