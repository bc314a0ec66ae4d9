//! Values written back as TOML for `justonce config`, with URL passwords and secret query
//! parameters as `***`.

use toml::de::DeValue;

/// `value` as TOML, with URL passwords and secret query parameters as `***`.
pub fn toml_value(value: &DeValue<'_>) -> String {
    match value {
        DeValue::String(text) => quoted(&redacted(text)),
        DeValue::Integer(integer) => {
            let prefix = match integer.radix() {
                16 => "0x",
                8 => "0o",
                2 => "0b",
                _ => "",
            };
            format!("{prefix}{}", integer.as_str())
        }
        DeValue::Float(float) => float.as_str().to_owned(),
        DeValue::Boolean(boolean) => boolean.to_string(),
        DeValue::Datetime(datetime) => datetime.to_string(),
        DeValue::Array(items) => {
            let items: Vec<String> = items.iter().map(|i| toml_value(i.get_ref())).collect();
            format!("[{}]", items.join(", "))
        }
        DeValue::Table(table) => {
            let entries: Vec<String> = table
                .iter()
                .map(|(k, v)| {
                    format!(
                        "{} = {}",
                        bare_or_quoted(k.get_ref()),
                        toml_value(v.get_ref())
                    )
                })
                .collect();
            format!("{{ {} }}", entries.join(", "))
        }
    }
}

/// A TOML basic string.
pub fn quoted(text: &str) -> String {
    let mut quoted = String::with_capacity(text.len() + 2);
    quoted.push('"');
    for c in text.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            '\t' => quoted.push_str("\\t"),
            '\n' => quoted.push_str("\\n"),
            '\r' => quoted.push_str("\\r"),
            c if c.is_control() => quoted.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted
}

/// A TOML key: bare when it can be.
pub fn bare_or_quoted(key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if bare { key.to_owned() } else { quoted(key) }
}

/// `text` with the user information of a URL (the password, or a user that may be a
/// token) and any query parameter that names a password, secret or token as `***`. A list
/// of URLs separated by commas, such as a NATS cluster's servers, has each one redacted.
pub fn redacted(text: &str) -> String {
    let mut urls = Vec::new();
    let mut rest = text;
    // A comma followed by a scheme begins the next URL; other commas (hosts of one
    // PostgreSQL URL, Kafka's bootstrap servers) belong to the URL they are in.
    while let Some(next) = rest
        .match_indices(',')
        .map(|(comma, _)| comma)
        .find(|&comma| starts_with_scheme(&rest[comma + 1..]))
    {
        urls.push(redacted_url(&rest[..next]));
        rest = &rest[next + 1..];
    }
    urls.push(redacted_url(rest));
    urls.join(",")
}

/// Whether `text` begins with `scheme://`.
fn starts_with_scheme(text: &str) -> bool {
    text.split_once("://").is_some_and(|(scheme, _)| {
        scheme.starts_with(|c: char| c.is_ascii_alphabetic())
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    })
}

/// One URL as [`redacted`] shows it.
fn redacted_url(text: &str) -> String {
    let mut redacted = text.to_owned();
    if let Some((scheme, rest)) = text.split_once("://") {
        let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
        if let Some(at) = authority.rfind('@') {
            let user = match authority[..at].split_once(':') {
                Some((user, _)) => format!("{user}:***"),
                None => "***".to_owned(),
            };
            redacted = format!("{scheme}://{user}@{}", &rest[at + 1..]);
        }
    }
    if let Some((base, query)) = redacted.split_once('?') {
        let query: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((name, _))
                    if ["password", "secret", "token"]
                        .iter()
                        .any(|word| name.to_ascii_lowercase().contains(word)) =>
                {
                    format!("{name}=***")
                }
                _ => pair.to_owned(),
            })
            .collect();
        redacted = format!("{base}?{}", query.join("&"));
    }
    redacted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_printed_without_their_passwords() {
        for (url, shown) in [
            ("postgres://u:pw@h:5432/db", "postgres://u:***@h:5432/db"),
            ("https://token@h/p?q=1", "https://***@h/p?q=1"),
            (
                "mysql://h/db?user=u&password=pw",
                "mysql://h/db?user=u&password=***",
            ),
            ("nats://h:4222?auth_token=t", "nats://h:4222?auth_token=***"),
            (
                "nats://u:pw@a:4222,nats://u:pw@b:4222",
                "nats://u:***@a:4222,nats://u:***@b:4222",
            ),
            (
                "postgres://u:pw@a:5432,b:5432/db",
                "postgres://u:***@a:5432,b:5432/db",
            ),
            ("http://h/p@x", "http://h/p@x"),
            ("env:ORDERS_BROKER", "env:ORDERS_BROKER"),
        ] {
            assert_eq!(redacted(url), shown, "{url}");
        }
        assert_eq!(quoted("a\"b\\c\u{7f}"), "\"a\\\"b\\\\c\\u007F\"");
    }
}
