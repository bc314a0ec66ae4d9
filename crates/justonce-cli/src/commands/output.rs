//! How the commands print: counts with their nouns, tables in aligned columns.

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

/// A tenant scope as the tables and `keys show` print it: `(none)` for no scope.
pub fn scope_or_none(scope: &str) -> &str {
    match scope {
        "" => "(none)",
        scope => scope,
    }
}
