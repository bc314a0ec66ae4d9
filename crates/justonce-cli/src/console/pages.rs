//! The console's pages, each drawn from the library calls the admin API's handlers make.
//! Filters are query parameters, checked as the API checks them; a form's empty field is
//! no filter.

use super::chart::{Series, bars};
use super::{ConsoleState, escape, page};
use crate::admin_api::dashboard::range;
use crate::admin_api::events::time;
use crate::admin_api::params::{MAX_LIMIT, Params, path_id};
use crate::admin_api::problem::ApiError;
use crate::commands::output::utc_text;
use crate::probes::Connection;
use axum::extract::{Path, RawQuery, State};
use axum::http::HeaderMap;
use axum::response::Response;
use base64::Engine;
use justonce_sql::{Backend, EventFilter, EventState};
use std::fmt::Write;
use std::time::Duration;

/// Events one page of the search lists.
const EVENTS_SHOWN: u32 = 100;

/// `/`: the activity of a range (`?since=1h`, `6h`, `24h`) and the backlog.
pub async fn dashboard<DB: Backend>(
    State(console): State<ConsoleState<DB>>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    page(&console, &headers, "Dashboard", async {
        let params = Params::parse(filled(&query).as_deref(), &["since"])?;
        let shown = params.text("since").unwrap_or("1h").to_owned();
        let dashboard = console.inbox.outbox().dashboard(range(&params)?).await?;
        let totals = &dashboard.totals;
        let mut main = String::from("<main><h1>Dashboard</h1><p class=\"range\">Range:");
        for choice in ["1h", "6h", "24h"] {
            let current = if choice == shown {
                " aria-current=\"page\""
            } else {
                ""
            };
            let _ = write!(main, " <a href=\"/?since={choice}\"{current}>{choice}</a>");
        }
        let oldest = dashboard
            .oldest_due
            .map(|age| age.as_secs().to_string())
            .unwrap_or_default();
        let _ = write!(
            main,
            " · since {}</p><dl class=\"figures\">\
             <div><dt>Accepted</dt><dd data-figure=\"accepted\">{}</dd></div>\
             <div><dt>Duplicates</dt><dd data-figure=\"duplicates\">{}</dd></div>\
             <div><dt>Sent</dt><dd data-figure=\"sent\">{}</dd></div>\
             <div><dt>Failed attempts</dt><dd data-figure=\"failed\">{}</dd></div>\
             <div><dt>Waiting now</dt><dd data-figure=\"backlog\">{}</dd></div>\
             <div><dt>Oldest waiting (s)</dt><dd data-figure=\"oldest-due\">{oldest}</dd></div>\
             </dl>",
            utc_text(dashboard.since),
            totals.accepted,
            totals.duplicates,
            totals.sent,
            totals.failed,
            dashboard.due,
        );
        let series = |name, class, value: fn(&justonce_sql::DashboardTotals) -> u64| Series {
            name,
            class,
            values: dashboard.minutes.iter().map(|m| value(&m.counts)).collect(),
        };
        let _ = write!(
            main,
            "<h2>Events per minute</h2>{}<h2>Deliveries per minute</h2>{}",
            bars(
                "events accepted and duplicates per minute",
                &series("accepted", "accepted", |c| c.accepted),
                &series("duplicates", "duplicates", |c| c.duplicates),
            ),
            bars(
                "deliveries sent and failed attempts per minute",
                &series("sent", "sent", |c| c.sent),
                &series("failed", "failed", |c| c.failed),
            ),
        );
        main.push_str(
            "<h2>By source or consumer</h2><table id=\"destinations\"><thead><tr>\
             <th>Name</th><th>Accepted</th><th>Duplicates</th><th>Sent</th><th>Failed</th>\
             <th>Waiting</th><th>Oldest waiting (s)</th></tr></thead><tbody>",
        );
        for destination in &dashboard.destinations {
            let t = &destination.totals;
            let _ = write!(
                main,
                "<tr data-destination=\"{name}\"><td><a href=\"/events?source={query}\">{name}</a>\
                 </td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                t.accepted,
                t.duplicates,
                t.sent,
                t.failed,
                destination.due,
                destination
                    .oldest_due
                    .map(|age| age.as_secs().to_string())
                    .unwrap_or_default(),
                name = escape(&destination.name),
                query = query_value(&destination.name),
            );
        }
        main.push_str("</tbody></table></main>");
        Ok(main)
    })
    .await
}

/// How the search box matches a key: `prefix` (its start, served by an index) or
/// `contains` (any part of it).
const KEY_MATCHES: [(&str, &str); 2] = [("prefix", "starts with"), ("contains", "contains")];

/// `/events`: a search by key (its start, or any part of it), source or consumer, state and
/// time received.
pub async fn events<DB: Backend>(
    State(console): State<ConsoleState<DB>>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    page(&console, &headers, "Events", async {
        let known = ["key", "match", "source", "state", "since", "cursor"];
        let params = Params::parse(filled(&query).as_deref(), &known)?;
        let matching = params.text("match").unwrap_or("prefix");
        let mut filter = EventFilter::default().limit(EVENTS_SHOWN);
        if let Some(key) = params.key_text("key")? {
            filter = match matching {
                "prefix" => filter.key_prefix(key),
                "contains" => filter.key_contains(key),
                other => {
                    return Err(ApiError::bad(
                        "match",
                        format!("match: {other:?} is not one of prefix, contains"),
                    ));
                }
            };
        }
        if let Some(origin) = params.text("source") {
            filter = filter.origin(origin);
        }
        if let Some(state) = params.text("state") {
            let state = state
                .parse()
                .map_err(|problem| ApiError::bad("state", format!("state: {problem}")))?;
            filter = filter.state(state);
        }
        if let Some(since) = time(&params, "since")? {
            filter = filter.since(since);
        }
        if let Some(cursor) = params.text("cursor") {
            filter = filter.after(cursor)?;
        }
        let found = console.inbox.outbox().events(&filter).await?;
        let value = |name| escape(params.text(name).unwrap_or_default());
        let selected = |chosen: bool| if chosen { " selected" } else { "" };
        let mut main = String::from(
            "<main><h1>Events</h1><form id=\"event-search\" method=\"get\" action=\"/events\">\
             <label>Key <select name=\"match\">",
        );
        for (choice, label) in KEY_MATCHES {
            let selected = selected(choice == matching);
            let _ = write!(
                main,
                "<option value=\"{choice}\"{selected}>{label}</option>"
            );
        }
        let _ = write!(
            main,
            "</select> <input name=\"key\" value=\"{}\"></label> \
             <label>Source or consumer <input name=\"source\" value=\"{}\"></label> \
             <label>State <select name=\"state\"><option value=\"\">any</option>",
            value("key"),
            value("source"),
        );
        for state in EventState::ALL {
            let selected = selected(params.text("state") == Some(state.as_str()));
            let _ = write!(main, "<option{selected}>{state}</option>");
        }
        let _ = write!(
            main,
            "</select></label> <label>Received since <input name=\"since\" value=\"{}\" \
             placeholder=\"2h or 2026-12-01T09:00:00Z\"></label> \
             <button type=\"submit\">Search</button></form>\
             <table id=\"events\"><thead><tr><th>Id</th><th>Key</th><th>Origin</th>\
             <th>Received</th><th>State</th><th>Attempts</th><th>Last error</th></tr></thead>\
             <tbody>",
            value("since"),
        );
        for event in &found.events {
            let _ = write!(
                main,
                "<tr data-event-id=\"{id}\"><td><a href=\"/events/{id}\">{id}</a></td>\
                 <td><code>{}</code></td><td>{}</td><td>{}</td><td class=\"{state}\">{state}</td>\
                 <td>{}</td><td>{}</td></tr>",
                escape(&event.key),
                escape(&event.origin),
                utc_text(event.received_at),
                event.attempts,
                escape(event.last_error.as_deref().unwrap_or_default()),
                id = event.id,
                state = event.state,
            );
        }
        main.push_str("</tbody></table>");
        if found.events.is_empty() {
            main.push_str("<p>No stored event matches.</p>");
        }
        if let Some(since) = found.searched_since {
            let _ = write!(
                main,
                "<p id=\"searched-since\">Keys containing the text were searched among the \
                 events received since {}. Set Received since to search further back.</p>",
                utc_text(since)
            );
        }
        if let Some(next) = &found.next {
            let mut next_query = form_urlencoded::Serializer::new(String::new());
            for name in ["key", "match", "source", "state", "since"] {
                if let Some(value) = params.text(name) {
                    next_query.append_pair(name, value);
                }
            }
            // The window a search by part of a key read, fixed: a link pasted later shows
            // the same events.
            if let Some(since) = found.searched_since {
                next_query.append_pair("since", &utc_text(since));
            }
            next_query.append_pair("cursor", next);
            let _ = write!(
                main,
                "<p><a rel=\"next\" href=\"/events?{}\">Later events</a></p>",
                escape(&next_query.finish())
            );
        }
        main.push_str("</main>");
        Ok(main)
    })
    .await
}

/// `/events/{id}`: an event's body, headers and every delivery attempt, and its replay.
pub async fn event<DB: Backend>(
    State(console): State<ConsoleState<DB>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    page(&console, &headers, "Event", async {
        Params::parse(filled(&query).as_deref(), &[])?;
        let id = path_id("id", &id)?;
        let shown = console.inbox.outbox().event(id).await?;
        let shown = shown.ok_or_else(|| ApiError::NotFound(format!("no event has id {id}")))?;
        let event = &shown.event;
        let mut main = format!(
            "<main><h1>Event {id}</h1><dl class=\"facts\">\
             <div><dt>Key</dt><dd><code>{}</code></dd></div>\
             <div><dt>Origin</dt><dd><a href=\"/events?source={}\">{}</a></dd></div>\
             <div><dt>Received</dt><dd>{}</dd></div>\
             <div><dt>State</dt><dd class=\"{state}\">{state}</dd></div>\
             <div><dt>Attempts since stored or replayed</dt><dd>{}</dd></div></dl>{}",
            escape(&event.key),
            query_value(&event.origin),
            escape(&event.origin),
            utc_text(event.received_at),
            event.attempts,
            replay_button("replay", "", id, "Replay this event"),
            state = event.state,
        );
        main.push_str(
            "<h2>Attempts</h2><table id=\"attempts\"><thead><tr><th>#</th><th>Started</th>\
             <th>Took (ms)</th><th>Status or error</th><th>Start of the answer</th></tr></thead>\
             <tbody>",
        );
        for attempt in &shown.attempts {
            let outcome = match (&attempt.error, attempt.status) {
                (Some(error), _) => format!("<span class=\"failed\">{}</span>", escape(error)),
                (None, Some(status)) => format!("<span class=\"sent\">{status}</span>"),
                (None, None) => "<span class=\"sent\">taken</span>".to_owned(),
            };
            let _ = write!(
                main,
                "<tr class=\"attempt\"><td>{}</td><td>{}</td><td>{}</td><td>{outcome}</td>\
                 <td><code>{}</code></td></tr>",
                attempt.attempt,
                utc_text(attempt.started_at),
                attempt.duration.as_millis(),
                escape(attempt.answer.as_deref().unwrap_or_default()),
            );
        }
        main.push_str("</tbody></table>");
        if shown.attempts.is_empty() {
            main.push_str("<p>Not tried yet.</p>");
        }
        main.push_str("<h2>Headers</h2><table id=\"headers\"><tbody>");
        for (name, value) in &shown.headers {
            let _ = write!(
                main,
                "<tr><th>{}</th><td><code>{}</code></td></tr>",
                escape(name),
                escape(value)
            );
        }
        let _ = write!(
            main,
            "</tbody></table><h2>Body</h2>{}</main>",
            body(&shown.payload)
        );
        Ok(main)
    })
    .await
}

/// A stored body, safe: pretty when it is JSON, as text when UTF-8, else in base64.
fn body(payload: &[u8]) -> String {
    let Ok(text) = std::str::from_utf8(payload) else {
        return format!(
            "<p class=\"note\">The body is not UTF-8 text: shown in base64.</p>\
             <pre id=\"event-body\">{}</pre>",
            base64::engine::general_purpose::STANDARD.encode(payload)
        );
    };
    let pretty = serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .and_then(|json| serde_json::to_string_pretty(&json).ok());
    format!(
        "<pre id=\"event-body\">{}</pre>",
        escape(pretty.as_deref().unwrap_or(text))
    )
}

/// `/dead-letters`: newest first, by destination and time, each with its replay, and the
/// replay of all that match.
pub async fn dead_letters<DB: Backend>(
    State(console): State<ConsoleState<DB>>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    page(&console, &headers, "Dead letters", async {
        let params = Params::parse(filled(&query).as_deref(), &["destination", "since"])?;
        let filter = params.window()?.limit(MAX_LIMIT);
        let mut rows = console.inbox.outbox().list_dead(&filter).await?;
        rows.reverse();
        let value = |name| escape(params.text(name).unwrap_or_default());
        let mut main = format!(
            "<main><h1>Dead letters</h1><form id=\"dead-letter-filter\" method=\"get\" \
             action=\"/dead-letters\"><label>Source or consumer <input name=\"destination\" \
             value=\"{}\"></label> <label>Written within <input name=\"since\" value=\"{}\" \
             placeholder=\"2h\"></label> <button type=\"submit\">Filter</button></form>",
            value("destination"),
            value("since"),
        );
        // The API's replay of many takes the same filter, or all=true for none.
        let matching = match filled(&query) {
            Some(query) => query,
            None => "all=true".to_owned(),
        };
        // The page lists at most MAX_LIMIT; the replay takes every one that matches.
        let label = match u32::try_from(rows.len()) {
            Ok(listed) if listed < MAX_LIMIT => format!("Replay all {listed} that match"),
            _ => format!("Replay all that match ({MAX_LIMIT} or more)"),
        };
        main.push_str(&replay_button(
            "replay-matching",
            &format!(
                " data-query=\"{}\" data-confirm=\"Replay every dead letter that matches?\"",
                escape(&matching)
            ),
            0,
            &label,
        ));
        main.push_str(
            "<table id=\"dead-letters\"><thead><tr><th>Id</th><th>Source or consumer</th>\
             <th>Key</th><th>Attempts</th><th>Age</th><th>Last error</th><th></th></tr></thead>\
             <tbody>",
        );
        for row in &rows {
            let _ = write!(
                main,
                "<tr data-dead-letter-id=\"{id}\"><td><a href=\"/events/{id}\">{id}</a></td>\
                 <td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
                 </tr>",
                escape(&row.destination),
                escape(&row.key),
                row.attempts,
                age(row.age),
                escape(row.last_error.as_deref().unwrap_or_default()),
                replay_button("", " class=\"replay\"", row.id, "Replay"),
                id = row.id,
            );
        }
        main.push_str("</tbody></table>");
        if rows.is_empty() {
            main.push_str("<p>No dead letter matches.</p>");
        } else if rows.len() == MAX_LIMIT as usize {
            let _ = write!(
                main,
                "<p class=\"note\">The {MAX_LIMIT} oldest are listed: narrow the filter to see \
                 the others.</p>"
            );
        }
        main.push_str("</main>");
        Ok(main)
    })
    .await
}

/// `/consumers`: each consumer's connection, its deliveries waiting (its lag) and the
/// offsets it stored.
pub async fn consumers<DB: Backend>(
    State(console): State<ConsoleState<DB>>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    page(&console, &headers, "Consumers", async {
        Params::parse(filled(&query).as_deref(), &[])?;
        let offsets = console.inbox.all_offsets().await?;
        let by_destination = console.inbox.outbox().stats_by_destination().await?;
        let mut main = String::from(
            "<main><h1>Consumers</h1><table id=\"consumers\"><thead><tr><th>Name</th>\
             <th>Connection</th><th>Waiting</th><th>Oldest waiting</th><th>Dead letters</th>\
             <th>Stored offsets</th></tr></thead><tbody>",
        );
        let states = console.consumers.states();
        for (name, state) in &states {
            let connection = match state {
                Connection::Connected => "<span class=\"sent\">connected</span>".to_owned(),
                other => format!(
                    "<span class=\"failed\">{}</span>",
                    escape(&other.to_string())
                ),
            };
            // A consumer's deliveries go to the destination named after it.
            let counts = by_destination
                .iter()
                .find(|(destination, _)| destination == name)
                .map(|(_, counts)| *counts);
            let stored: Vec<String> = offsets
                .iter()
                .filter(|stored| stored.consumer == *name)
                .map(|stored| {
                    format!(
                        "<li><code>{}</code> partition {}: {}</li>",
                        escape(&stored.stream),
                        stored.partition,
                        stored.offset.position
                    )
                })
                .collect();
            let _ = write!(
                main,
                "<tr data-consumer=\"{name}\"><td><a href=\"/events?source={query}\">{name}</a>\
                 </td><td>{connection}</td><td>{}</td><td>{}</td><td>{}</td><td><ul>{}</ul></td>\
                 </tr>",
                counts.map_or(0, |c| c.due),
                counts
                    .filter(|c| c.due > 0)
                    .map(|c| age(c.oldest_due))
                    .unwrap_or_default(),
                counts.map_or(0, |c| c.dead),
                stored.concat(),
                name = escape(name),
                query = query_value(name),
            );
        }
        main.push_str("</tbody></table>");
        if states.is_empty() {
            main.push_str("<p>No consumer is configured.</p>");
        }
        main.push_str("</main>");
        Ok(main)
    })
    .await
}

/// A replay button, which the script sends to the admin API. Without a token set, the API
/// refuses it with a `403` that says how to set one, and the page shows that.
fn replay_button(id: &str, attributes: &str, target: i64, label: &str) -> String {
    let id = match id {
        "" => String::new(),
        id => format!(" id=\"{id}\""),
    };
    format!(
        "<button type=\"button\"{id}{attributes} data-id=\"{target}\">{}</button>",
        escape(label)
    )
}

/// The query without its empty parameters: a form sends its empty fields.
fn filled(query: &Option<String>) -> Option<String> {
    let query = query.as_deref()?;
    let mut kept = form_urlencoded::Serializer::new(String::new());
    let mut any = false;
    for (name, value) in form_urlencoded::parse(query.as_bytes()) {
        if !value.is_empty() {
            kept.append_pair(&name, &value);
            any = true;
        }
    }
    any.then(|| kept.finish())
}

/// `value` as a query parameter's value, safe in an attribute.
fn query_value(value: &str) -> String {
    escape(&form_urlencoded::byte_serialize(value.as_bytes()).collect::<String>())
}

/// An age in whole seconds, such as `75 s`.
fn age(age: Duration) -> String {
    format!("{} s", age.as_secs())
}
