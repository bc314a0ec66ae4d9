//! How the commands print: counts with their nouns, tables in aligned columns, times; and
//! how they ask before changing what cannot be undone.

use anyhow::Result;
use base64::Engine;
use justonce_cli_support::Usage;
use justonce_sql::Attempt;
use std::io::{BufRead, IsTerminal, Write};
use std::time::{Duration, SystemTime};

/// `1 key`, `2 keys`: a count with its noun, `one` or `many`.
pub fn counted(
    count: impl TryInto<u64> + std::fmt::Display + Copy,
    one: &str,
    many: &str,
) -> String {
    match count.try_into() {
        Ok(1) => format!("1 {one}"),
        _ => format!("{count} {many}"),
    }
}

/// Prints `rows` under `title` in aligned columns, or that there are none.
pub fn print_table(title: &str, header: &[&str], rows: impl IntoIterator<Item = Vec<String>>) {
    let rows: Vec<Vec<String>> = rows.into_iter().collect();
    if rows.is_empty() {
        println!("{title}: none\n");
        return;
    }
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        println!("  {}", padded.join("  ").trim_end());
    };
    println!("{title}");
    line(header.to_vec());
    for row in &rows {
        line(row.iter().map(String::as_str).collect());
    }
    println!();
}

/// `text` on one line of a table: each run of whitespace, newlines among them, one space.
pub fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A tenant scope as the tables and `keys show` print it: `(none)` for no scope.
pub fn scope_or_none(scope: &str) -> &str {
    match scope {
        "" => "(none)",
        scope => scope,
    }
}

/// Asks `question` on the terminal unless `yes`, and fails unless the answer is yes. With
/// no terminal to ask on, only `--yes` goes ahead.
pub fn confirm(question: &str, yes: bool) -> Result<()> {
    if yes {
        return Ok(());
    }
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Err(Usage(
            "stdin is not a terminal to confirm on: pass --yes to go ahead; nothing changed"
                .to_owned(),
        )
        .into());
    }
    eprint!("{question} [y/N] ");
    std::io::stderr().flush()?;
    let mut answer = String::new();
    stdin.lock().read_line(&mut answer)?;
    if matches!(answer.trim().to_lowercase().as_str(), "y" | "yes") {
        Ok(())
    } else {
        anyhow::bail!("not confirmed: nothing changed")
    }
}

/// `time` in UTC as RFC 3339 with milliseconds, such as `2026-12-02T11:07:40.123Z`.
pub fn utc_text(time: SystemTime) -> String {
    let since_epoch = time
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    let seconds = since_epoch.as_secs();
    let (days, of_day) = (seconds / 86_400, seconds % 86_400);
    // Days to a civil date, after Howard Hinnant's `civil_from_days`.
    let shifted = days as i64 + 719_468;
    let era = shifted.div_euclid(146_097);
    let of_era = shifted.rem_euclid(146_097);
    let year_of_era = (of_era - of_era / 1_460 + of_era / 36_524 - of_era / 146_096) / 365;
    let day_of_year = of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        of_day / 3_600,
        of_day / 60 % 60,
        of_day % 60,
        since_epoch.subsec_millis()
    )
}

/// Stored bytes as `name` when they are UTF-8 text, else as `<name>_base64`: the one shape
/// of a body or result in every JSON the commands print and the admin API answers.
pub fn bytes_json(object: &mut serde_json::Value, name: &str, bytes: &[u8]) {
    match std::str::from_utf8(bytes) {
        Ok(text) => object[name] = text.into(),
        Err(_) => {
            object[format!("{name}_base64")] = base64::engine::general_purpose::STANDARD
                .encode(bytes)
                .into()
        }
    }
}

/// One delivery attempt as JSON.
pub fn attempt_json(attempt: &Attempt) -> serde_json::Value {
    serde_json::json!({
        "attempt": attempt.attempt,
        "started_at": utc_text(attempt.started_at),
        "duration_ms": u64::try_from(attempt.duration.as_millis()).unwrap_or(u64::MAX),
        "status": attempt.status,
        "answer": attempt.answer,
        "error": attempt.error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_print_as_rfc_3339_in_utc() {
        let at = |ms: u64| utc_text(SystemTime::UNIX_EPOCH + Duration::from_millis(ms));
        assert_eq!(at(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(at(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(at(1_796_210_860_123), "2026-12-02T11:27:40.123Z");
    }
}
