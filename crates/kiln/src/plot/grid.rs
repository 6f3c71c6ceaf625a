//! A grid of images as one PNG (a workload's samples).

use std::path::Path;

use kiln_engine::error::{Error, Result};

/// Writes greyscale images as one PNG grid, atomically: `pixels` holds `count` images of
/// `height × width` values in `[0, 1]` (clamped), one after another, drawn `columns` to a row
/// with a one-pixel gap, each pixel `scale` pixels wide. For a workload's snapshots (generated
/// samples, reconstructions).
pub fn save_image_grid(
    path: &Path,
    pixels: &[f32],
    height: usize,
    width: usize,
    columns: usize,
    scale: usize,
) -> Result<()> {
    let per = height * width;
    if per == 0 || columns == 0 || scale == 0 || !pixels.len().is_multiple_of(per) {
        return Err(Error::config(format!(
            "{}: an image grid needs whole images of {height}×{width} pixels, {columns} columns \
             and a scale of at least 1 ({} values given)",
            path.display(),
            pixels.len()
        )));
    }
    let count = pixels.len() / per;
    let rows = count.div_ceil(columns).max(1);
    let cell_w = width * scale + 1;
    let cell_h = height * scale + 1;
    let (w, h) = (columns * cell_w + 1, rows * cell_h + 1);
    // The gaps are mid-grey, so that white and black images both show their edges.
    let mut canvas = vec![96u8; w * h];
    for i in 0..count {
        let (r, c) = (i / columns, i % columns);
        for y in 0..height * scale {
            for x in 0..width * scale {
                let v = pixels[i * per + (y / scale) * width + x / scale];
                let at = (r * cell_h + 1 + y) * w + c * cell_w + 1 + x;
                canvas[at] = (v.clamp(0.0, 1.0) * 255.0).round() as u8;
            }
        }
    }
    let mut bytes = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut bytes, w as u32, h as u32);
        encoder.set_color(png::ColorType::Grayscale);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder
            .write_header()
            .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        writer
            .write_image_data(&canvas)
            .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    kiln_engine::files::write_atomic(path, &bytes)
}
