//! Numeric tables from CSV files: a header row names the columns, every other row holds one
//! sample's numbers; one column is the target, the others (or a chosen few) the features.

use std::path::{Path, PathBuf};

use crate::error::DatasetError;

/// A table of samples: features row-major in `f32`, one target per row.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    /// The file it was read from.
    pub path: PathBuf,
    /// The feature columns' names, in order.
    pub features: Vec<String>,
    /// The target column's name.
    pub target: String,
    /// `rows × features.len()` values.
    pub values: Vec<f32>,
    /// One target per row.
    pub targets: Vec<f32>,
}

impl Table {
    /// Reads the CSV file at `path`: `target` names the target column; `features` the feature
    /// columns (empty: every other column). Every cell of those columns must be a number; an
    /// empty file, a missing column, a row of another length or a cell that is not a number is
    /// an error naming the file, the line and the column.
    pub fn read_csv(path: &Path, target: &str, features: &[String]) -> Result<Self, DatasetError> {
        let mut reader = csv::ReaderBuilder::new()
            .has_headers(true)
            .trim(csv::Trim::All)
            .from_path(path)
            .map_err(|e| match e.into_kind() {
                csv::ErrorKind::Io(io) => DatasetError::io(path, "cannot read", io),
                other => DatasetError::bad(path, format!("{other:?}")),
            })?;
        let header: Vec<String> = reader
            .headers()
            .map_err(|e| DatasetError::bad(path, format!("cannot read the header row: {e}")))?
            .iter()
            .map(str::to_string)
            .collect();
        if header.is_empty() || header.iter().all(String::is_empty) {
            return Err(DatasetError::bad(
                path,
                "is empty (expected a header row naming the columns, then one row per sample)",
            ));
        }
        let column = |name: &str, key: &str| {
            header.iter().position(|h| h == name).ok_or_else(|| {
                DatasetError::bad(
                    path,
                    format!(
                        "has no column `{name}` (data.{key}); its columns: {}",
                        header.join(", ")
                    ),
                )
            })
        };
        let target_at = column(target, "target")?;
        let feature_at: Vec<usize> = if features.is_empty() {
            (0..header.len()).filter(|&i| i != target_at).collect()
        } else {
            features
                .iter()
                .map(|f| column(f, "features"))
                .collect::<Result<_, _>>()?
        };
        if feature_at.is_empty() {
            return Err(DatasetError::bad(
                path,
                format!("has no feature columns besides the target `{target}`"),
            ));
        }
        let mut values = Vec::new();
        let mut targets = Vec::new();
        for (row, record) in reader.records().enumerate() {
            // Line numbers count the header as line 1.
            let line = record
                .as_ref()
                .ok()
                .and_then(|r| r.position())
                .map_or(row + 2, |p| p.line() as usize);
            let record = record.map_err(|e| {
                DatasetError::bad(path, format!("line {line}: {}", one_line(&e.to_string())))
            })?;
            let cell = |at: usize| -> Result<f32, DatasetError> {
                let raw = record.get(at).unwrap_or("");
                raw.parse::<f32>()
                    .ok()
                    .filter(|v| v.is_finite())
                    .ok_or_else(|| {
                        DatasetError::bad(
                            path,
                            format!(
                                "line {line}, column `{}`: {raw:?} is not a finite number",
                                header[at]
                            ),
                        )
                    })
            };
            for &at in &feature_at {
                values.push(cell(at)?);
            }
            targets.push(cell(target_at)?);
        }
        if targets.is_empty() {
            return Err(DatasetError::bad(path, "has a header but no rows"));
        }
        Ok(Self {
            path: path.to_path_buf(),
            features: feature_at.iter().map(|&i| header[i].clone()).collect(),
            target: target.to_string(),
            values,
            targets,
        })
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.targets.len()
    }

    /// Whether the table has no rows (never, once read).
    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    /// Number of feature columns.
    pub fn width(&self) -> usize {
        self.features.len()
    }

    /// The features of row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.values[i * self.width()..(i + 1) * self.width()]
    }

    /// The classes of a classification target: every target a whole number from 0, and the
    /// number of classes (the largest + 1); an error naming the first row that is not.
    pub fn classes(&self) -> Result<usize, DatasetError> {
        let mut max = 0;
        for (i, &t) in self.targets.iter().enumerate() {
            if t < 0.0 || t.fract() != 0.0 || t > 65_535.0 {
                return Err(DatasetError::bad(
                    &self.path,
                    format!(
                        "row {} (line {}), column `{}`: {t} is not a class (a whole number from \
                         0); a regression target needs a model of its own",
                        i + 1,
                        i + 2,
                        self.target
                    ),
                ));
            }
            max = max.max(t as usize);
        }
        Ok(max + 1)
    }

    /// The rows `indices` as a new table (a split).
    pub fn subset(&self, indices: &[usize]) -> Table {
        Table {
            path: self.path.clone(),
            features: self.features.clone(),
            target: self.target.clone(),
            values: indices.iter().flat_map(|&i| self.row(i)).copied().collect(),
            targets: indices.iter().map(|&i| self.targets[i]).collect(),
        }
    }

    /// Each feature's mean and standard deviation over the rows (a constant column's deviation
    /// reads as 1).
    pub fn moments(&self) -> Vec<(f32, f32)> {
        let n = self.len() as f64;
        (0..self.width())
            .map(|c| {
                let column = (0..self.len()).map(|r| f64::from(self.values[r * self.width() + c]));
                let mean = column.clone().sum::<f64>() / n;
                let var = column.map(|v| (v - mean).powi(2)).sum::<f64>() / n;
                let std = if var > 0.0 { var.sqrt() } else { 1.0 };
                (mean as f32, std as f32)
            })
            .collect()
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("kiln-table-{}-{name}.csv", std::process::id()))
    }

    fn write(name: &str, text: &str) -> PathBuf {
        let path = path(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn reads_features_and_target_and_names_bad_cells() {
        let p = write("ok", "a, b ,label\n1,2,0\n3,4.5,2\n");
        let t = Table::read_csv(&p, "label", &[]).unwrap();
        assert_eq!(t.features, ["a", "b"]);
        assert_eq!((t.len(), t.row(1)), (2, &[3.0, 4.5][..]));
        assert_eq!(t.classes().unwrap(), 3);
        let only_b = Table::read_csv(&p, "label", &["b".to_string()]).unwrap();
        assert_eq!(only_b.values, [2.0, 4.5]);
        assert_eq!(t.subset(&[1]).targets, [2.0]);
        let m = t.moments();
        assert_eq!(m[0], (2.0, 1.0));

        let e = Table::read_csv(&p, "y", &[]).unwrap_err().to_string();
        assert!(
            e.contains("no column `y`") && e.contains("a, b, label"),
            "{e}"
        );
        let p = write("cell", "a,label\n1,0\nx,1\n");
        let e = Table::read_csv(&p, "label", &[]).unwrap_err().to_string();
        assert!(
            e.contains("line 3, column `a`") && e.contains("\"x\""),
            "{e}"
        );
        let p = write("ragged", "a,label\n1,0\n2\n");
        let e = Table::read_csv(&p, "label", &[]).unwrap_err().to_string();
        assert!(e.contains("line 3"), "{e}");
        let p = write("empty", "");
        let e = Table::read_csv(&p, "label", &[]).unwrap_err().to_string();
        assert!(e.contains("is empty"), "{e}");
        let p = write("reg", "a,y\n1,0.5\n");
        let t = Table::read_csv(&p, "y", &[]).unwrap();
        assert!(
            t.classes()
                .unwrap_err()
                .to_string()
                .contains("0.5 is not a class")
        );
        for name in ["ok", "cell", "ragged", "empty", "reg"] {
            std::fs::remove_file(path(name)).unwrap();
        }
    }
}
