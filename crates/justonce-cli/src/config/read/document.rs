//! Finding values in the parsed document, and the setting at a position of the text.

use toml::Spanned;
use toml::de::{DeTable, DeValue};

/// The value at `path`.
pub fn value_at<'d, 'i>(
    table: &'d DeTable<'i>,
    path: &[String],
) -> Option<&'d Spanned<DeValue<'i>>> {
    let (first, rest) = path.split_first()?;
    let value = table.get(first.as_str())?;
    match (rest.is_empty(), value.get_ref()) {
        (true, _) => Some(value),
        (false, DeValue::Table(inner)) => value_at(inner, rest),
        (false, _) => None,
    }
}

/// The span of the value at `path`.
pub fn span_of(table: &DeTable<'_>, path: &[String]) -> Option<std::ops::Range<usize>> {
    value_at(table, path).map(Spanned::span)
}

/// The path of the innermost key whose key or value holds `offset`.
pub fn path_at(table: &DeTable<'_>, offset: usize) -> Vec<String> {
    for (key, value) in table {
        if let DeValue::Table(inner) = value.get_ref() {
            let inner_path = path_at(inner, offset);
            if !inner_path.is_empty() {
                return [vec![key.get_ref().to_string()], inner_path].concat();
            }
        }
        if key.span().contains(&offset) || value.span().contains(&offset) {
            return vec![key.get_ref().to_string()];
        }
    }
    Vec::new()
}
