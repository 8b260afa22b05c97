//! Drawing: line charts of one or more panels, stacked vertically, with a left and an optional
//! right value axis, written as PNG.

use std::{collections::HashMap, path::Path, sync::OnceLock};

use plotters::{
    chart::{DualCoordChartContext, SeriesLabelPosition},
    coord::{types::RangedCoordf64, Shift},
    prelude::*,
    style::{register_font, FontStyle},
};

use crate::PlotError;

/// Width and height of every chart, in pixels.
pub const CHART_SIZE: (u32, u32) = (1000, 600);

/// A subset of DejaVu Sans (fonts/LICENSE-DejaVu.txt), so text needs no system font.
const FONT: &[u8] = include_bytes!("../fonts/DejaVuSans-subset.ttf");
const FAMILY: &str = "sans-serif";

/// A series with fewer points than this is drawn as is; with more, as a faint raw line under
/// a centred moving average.
const SMOOTH_FROM: usize = 50;
/// Up to this many points also get a dot per point, so a single point is visible at all.
const MARKERS_UP_TO: usize = 30;

const BACKGROUND: RGBColor = WHITE;
/// matplotlib's `tab10`.
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// One series of a panel.
pub(crate) struct Line {
    pub label: String,
    /// `(step, value)`, steps ascending.
    pub points: Vec<(u64, f64)>,
    /// Drawn against the right axis.
    pub right: bool,
    /// A standard deviation per step, drawn as a band of ± one around the line (steps without a
    /// value of the line are ignored).
    pub std: Option<Vec<(u64, f64)>>,
}

impl Line {
    pub fn new(label: impl Into<String>, points: &[(u64, f64)]) -> Line {
        Line { label: label.into(), points: points.to_vec(), right: false, std: None }
    }
}

/// One chart: a caption, axes, a legend and its lines.
pub(crate) struct Panel {
    pub title: String,
    pub y_desc: String,
    /// Description of the right axis; used when a line is `right`.
    pub y2_desc: String,
    /// Stretch the value axes to include zero (for quantities that are never negative).
    pub from_zero: bool,
    pub lines: Vec<Line>,
}

impl Panel {
    /// Whether a line is drawn against the right axis: one is `right` and another is not.
    fn has_right_axis(&self) -> bool {
        let drawn = || self.lines.iter().filter(|l| !l.points.is_empty());
        drawn().any(|l| l.right) && drawn().any(|l| !l.right)
    }
}

/// Registers the embedded font as plotters' `sans-serif` once per process.
fn ensure_font() -> Result<(), PlotError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    if *REGISTERED.get_or_init(|| register_font(FAMILY, FontStyle::Normal, FONT).is_ok()) {
        Ok(())
    } else {
        Err(PlotError::Font)
    }
}

/// Draws `panels` stacked vertically into the PNG `path`.
pub(crate) fn draw(path: &Path, panels: &[Panel]) -> Result<(), PlotError> {
    ensure_font()?;
    let (width, height) = CHART_SIZE;
    let mut rgb = vec![0u8; width as usize * height as usize * 3];
    draw_into(&mut rgb, path, panels)?;
    write_png(path, &rgb).map_err(|message| PlotError::Draw { path: path.to_owned(), message })
}

/// Draws `panels` into `rgb` (RGB8 rows of [`CHART_SIZE`]); `path` names the chart in errors.
fn draw_into(rgb: &mut [u8], path: &Path, panels: &[Panel]) -> Result<(), PlotError> {
    let fail = |err: DrawingAreaErrorKind<_>| PlotError::Draw { path: path.to_owned(), message: err.to_string() };
    let root = BitMapBackend::with_buffer(rgb, CHART_SIZE).into_drawing_area();
    root.fill(&BACKGROUND).map_err(fail)?;
    // One step axis for all panels, so that they line up.
    let steps = panels.iter().flat_map(|p| &p.lines).flat_map(|l| &l.points).map(|&(step, _)| step as f64);
    let x_range = x_range(steps);
    // Room for a right axis in every panel if one has it, so that the plots line up as well.
    let right_axis = panels.iter().any(Panel::has_right_axis);
    for (area, panel) in root.split_evenly((panels.len().max(1), 1)).iter().zip(panels) {
        draw_panel(area, panel, x_range, right_axis).map_err(fail)?;
    }
    root.present().map_err(fail)?;
    Ok(())
}

/// Writes `rgb` (RGB8 rows of [`CHART_SIZE`]) as a PNG file.
fn write_png(path: &Path, rgb: &[u8]) -> Result<(), String> {
    let file = std::fs::File::create(path).map_err(|e| e.to_string())?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), CHART_SIZE.0, CHART_SIZE.1);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(|e| e.to_string())?;
    writer.write_image_data(rgb).map_err(|e| e.to_string())?;
    writer.finish().map_err(|e| e.to_string())
}

/// A line ready to draw: raw points, the smoothed line (or the raw one again) and the band.
struct Prepared<'a> {
    line: &'a Line,
    color: RGBColor,
    raw: Vec<(f64, f64)>,
    smooth: Option<Vec<(f64, f64)>>,
    band: Vec<(f64, f64, f64)>,
}

impl Prepared<'_> {
    fn main(&self) -> &[(f64, f64)] {
        self.smooth.as_deref().unwrap_or(&self.raw)
    }

    fn values(&self) -> impl Iterator<Item = f64> + '_ {
        self.raw.iter().map(|p| p.1).chain(self.band.iter().flat_map(|b| [b.1, b.2]))
    }
}

type Chart<'a, 'b> = DualCoordChartContext<
    'a,
    BitMapBackend<'b>,
    Cartesian2d<RangedCoordf64, RangedCoordf64>,
    Cartesian2d<RangedCoordf64, RangedCoordf64>,
>;

fn draw_panel<'b>(
    area: &DrawingArea<BitMapBackend<'b>, Shift>,
    panel: &Panel,
    (x_lo, x_hi): (f64, f64),
    reserve_right_axis: bool,
) -> Result<(), DrawingAreaErrorKind<<BitMapBackend<'b> as DrawingBackend>::ErrorType>> {
    let longest = panel.lines.iter().map(|l| l.points.len()).max().unwrap_or(0);
    let window = smoothing_window(longest);
    // With nothing on the left axis, the right-axis lines move over.
    let has_right = panel.has_right_axis();
    let prepared: Vec<Prepared> = panel
        .lines
        .iter()
        .filter(|l| !l.points.is_empty())
        .enumerate()
        .map(|(i, line)| prepare(line, COLORS[i % COLORS.len()], window))
        .collect();
    let is_right = |p: &Prepared| p.line.right && has_right;

    let left = value_range(prepared.iter().filter(|p| !is_right(p)).flat_map(Prepared::values), panel.from_zero);
    let right = value_range(prepared.iter().filter(|p| is_right(p)).flat_map(Prepared::values), panel.from_zero);

    let mut builder = ChartBuilder::on(area);
    builder.caption(&panel.title, (FAMILY, 22)).margin(12).margin_right(20).x_label_area_size(48).y_label_area_size(78);
    if has_right || reserve_right_axis {
        builder.right_y_label_area_size(78);
    }
    let mut chart: Chart =
        builder.build_cartesian_2d(x_lo..x_hi, left.0..left.1)?.set_secondary_coord(x_lo..x_hi, right.0..right.1);

    let x_fmt = |x: &f64| format!("{x:.0}");
    let left_fmt = tick_format(left);
    let right_fmt = tick_format(right);
    let x_desc = match window {
        1 => "step".to_owned(),
        w => format!("step   (bold: centred {w}-step moving average, faint: raw values)"),
    };
    // Integer steps: no more labels than there are steps.
    let x_labels = ((x_hi - x_lo).round() as usize + 1).clamp(2, 10);
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(&panel.y_desc)
        .x_labels(x_labels)
        .y_labels(8)
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&left_fmt)
        .label_style((FAMILY, 14))
        .axis_desc_style((FAMILY, 15))
        .bold_line_style(RGBColor(225, 225, 225))
        .light_line_style(RGBColor(245, 245, 245))
        .axis_style(RGBColor(120, 120, 120))
        .draw()?;
    if has_right {
        chart
            .configure_secondary_axes()
            .y_desc(&panel.y2_desc)
            .y_labels(8)
            .y_label_formatter(&right_fmt)
            .label_style((FAMILY, 14))
            .axis_desc_style((FAMILY, 15))
            .axis_style(RGBColor(120, 120, 120))
            .draw()?;
    }

    // Bands first, then faint raw lines, then the main lines on top.
    for p in &prepared {
        if p.band.len() >= 2 {
            let outline: Vec<(f64, f64)> =
                p.band.iter().map(|b| (b.0, b.2)).chain(p.band.iter().rev().map(|b| (b.0, b.1))).collect();
            let band = Polygon::new(outline, p.color.mix(0.15).filled());
            if is_right(p) {
                chart.draw_secondary_series([band])?;
            } else {
                chart.draw_series([band])?;
            }
        }
    }
    for p in prepared.iter().filter(|p| p.smooth.is_some()) {
        let faint = LineSeries::new(p.raw.iter().copied(), p.color.mix(0.25).stroke_width(1));
        if is_right(p) {
            chart.draw_secondary_series(faint)?;
        } else {
            chart.draw_series(faint)?;
        }
    }
    for p in &prepared {
        let color = p.color;
        let line = LineSeries::new(p.main().iter().copied(), color.stroke_width(2));
        let label = if is_right(p) { format!("{} (right axis)", p.line.label) } else { p.line.label.clone() };
        let anno = if is_right(p) { chart.draw_secondary_series(line)? } else { chart.draw_series(line)? };
        anno.label(label).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 22, y)], color.stroke_width(3)));
        if p.raw.len() <= MARKERS_UP_TO {
            let dots = p.raw.iter().map(|&q| Circle::new(q, 3, color.filled()));
            if is_right(p) {
                chart.draw_secondary_series(dots)?;
            } else {
                chart.draw_series(dots)?;
            }
        }
    }

    let position = legend_corner(&prepared, (x_lo, x_hi), left, right, is_right);
    chart
        .configure_series_labels()
        .position(position)
        .margin(8)
        .legend_area_size(28)
        .label_font((FAMILY, 14))
        .background_style(BACKGROUND.mix(0.85))
        .border_style(RGBColor(190, 190, 190))
        .draw()?;
    Ok(())
}

fn prepare(line: &Line, color: RGBColor, window: usize) -> Prepared<'_> {
    let raw: Vec<(f64, f64)> = line.points.iter().map(|&(s, v)| (s as f64, v)).collect();
    let values: Vec<f64> = line.points.iter().map(|p| p.1).collect();
    let center = if window > 1 { moving_average(&values, window) } else { values };
    let smooth = (window > 1).then(|| raw.iter().zip(&center).map(|(p, &c)| (p.0, c)).collect());
    let band = match &line.std {
        None => Vec::new(),
        Some(std) => {
            let by_step: HashMap<u64, f64> = std.iter().copied().collect();
            // Steps of the line that have a std; the std is smoothed like the line.
            let joined: Vec<(f64, f64, f64)> = line
                .points
                .iter()
                .zip(&center)
                .filter_map(|(&(s, _), &c)| by_step.get(&s).map(|&sd| (s as f64, c, sd)))
                .collect();
            let sds: Vec<f64> = joined.iter().map(|j| j.2).collect();
            let sds = if window > 1 { moving_average(&sds, window) } else { sds };
            joined.iter().zip(sds).map(|(&(x, c, _), sd)| (x, c - sd, c + sd)).collect()
        }
    };
    Prepared { line, color, raw, smooth, band }
}

/// The moving-average window (odd) for a series of `n` points; 1 means no smoothing.
fn smoothing_window(n: usize) -> usize {
    if n < SMOOTH_FROM {
        1
    } else {
        (n / 25).clamp(3, 101) | 1
    }
}

/// Centred moving average over `window` points, narrower at the ends.
pub(crate) fn moving_average(values: &[f64], window: usize) -> Vec<f64> {
    let half = window / 2;
    let mut prefix = vec![0.0; values.len() + 1];
    for (i, v) in values.iter().enumerate() {
        prefix[i + 1] = prefix[i] + v;
    }
    (0..values.len())
        .map(|i| {
            let (lo, hi) = (i.saturating_sub(half), (i + half + 1).min(values.len()));
            (prefix[hi] - prefix[lo]) / (hi - lo) as f64
        })
        .collect()
}

fn x_range(xs: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| (lo.min(x), hi.max(x)));
    if !lo.is_finite() {
        (0.0, 1.0)
    } else if lo == hi {
        (lo - 1.0, hi + 1.0)
    } else if hi - lo < 30.0 {
        // Few steps, drawn with a dot each: keep the end dots off the frame.
        (lo - 0.5, hi + 0.5)
    } else {
        (lo, hi)
    }
}

/// The value range of `values` with a margin of 5%, never empty.
pub(crate) fn value_range(values: impl Iterator<Item = f64>, from_zero: bool) -> (f64, f64) {
    let (mut lo, mut hi) =
        values.filter(|v| v.is_finite()).fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if from_zero {
        lo = lo.min(0.0);
        hi = hi.max(0.0);
    }
    if hi - lo <= f64::EPSILON * hi.abs().max(lo.abs()).max(1e-300) {
        let pad = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        return (lo - pad, hi + pad);
    }
    let pad = (hi - lo) * 0.05;
    (if from_zero && lo >= 0.0 { lo } else { lo - pad }, hi + pad)
}

/// Tick labels with as many decimals as the range needs, scientific for very large or small values.
pub(crate) fn tick_format((lo, hi): (f64, f64)) -> impl Fn(&f64) -> String {
    let magnitude = lo.abs().max(hi.abs());
    let scientific = !(1e-3..1e6).contains(&magnitude);
    // The decimals of the tick step: the smallest 1, 2 or 5 × 10^k that gives at most 8 ticks.
    let step = (hi - lo) / 8.0;
    let decimals = if step > 0.0 {
        let exponent = step.log10().floor();
        let exponent = if step / 10f64.powf(exponent) > 5.0 { exponent + 1.0 } else { exponent };
        (-exponent).clamp(0.0, 8.0) as usize
    } else {
        2
    };
    move |v: &f64| {
        let v = *v;
        if v == 0.0 {
            "0".to_owned()
        } else if scientific {
            format!("{v:.1e}")
        } else {
            let s = format!("{v:.decimals$}");
            if s.trim_start_matches('-').chars().all(|c| c == '0' || c == '.') {
                "0".to_owned()
            } else {
                s
            }
        }
    }
}

/// The plot corner with the fewest points in it (upper right on a tie).
fn legend_corner(
    prepared: &[Prepared],
    (x_lo, x_hi): (f64, f64),
    left: (f64, f64),
    right: (f64, f64),
    is_right: impl Fn(&Prepared) -> bool,
) -> SeriesLabelPosition {
    // (position, x from the left edge?, y from the top?)
    let corners = [
        (SeriesLabelPosition::UpperRight, false, true),
        (SeriesLabelPosition::UpperLeft, true, true),
        (SeriesLabelPosition::LowerRight, false, false),
        (SeriesLabelPosition::LowerLeft, true, false),
    ];
    let mut counts = [0usize; 4];
    for p in prepared {
        let (y_lo, y_hi) = if is_right(p) { right } else { left };
        for &(x, y) in p.main().iter().chain(&p.raw) {
            let nx = (x - x_lo) / (x_hi - x_lo);
            let ny = (y - y_lo) / (y_hi - y_lo);
            for (count, &(_, from_left, from_top)) in counts.iter_mut().zip(&corners) {
                let in_x = if from_left { nx <= 0.4 } else { nx >= 0.6 };
                let in_y = if from_top { ny >= 0.6 } else { ny <= 0.4 };
                *count += usize::from(in_x && in_y);
            }
        }
    }
    let best = (0..4).min_by_key(|&i| counts[i]).unwrap_or(0);
    corners[best].0.clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moving_average_is_centred_and_narrows_at_the_ends() {
        let avg = moving_average(&[1.0, 2.0, 3.0, 4.0, 5.0], 3);
        assert_eq!(avg, vec![1.5, 2.0, 3.0, 4.0, 4.5]);
        assert_eq!(moving_average(&[], 5), Vec::<f64>::new());
        assert_eq!(smoothing_window(10), 1);
        assert_eq!(smoothing_window(300), 13);
    }

    #[test]
    fn value_ranges_are_never_empty() {
        assert_eq!(value_range([2.0, 2.0].into_iter(), false), (1.8, 2.2));
        assert_eq!(value_range([0.0].into_iter(), false), (-1.0, 1.0));
        assert_eq!(value_range(std::iter::empty(), false), (0.0, 1.0));
        assert_eq!(value_range([5.0, 10.0].into_iter(), true), (0.0, 10.5));
        let (lo, hi) = value_range([-1.0, 1.0].into_iter(), false);
        assert!(lo < -1.0 && hi > 1.0);
    }

    #[test]
    fn tick_labels() {
        let f = tick_format((0.0, 1.0));
        assert_eq!(f(&0.30000000000000004), "0.3");
        assert_eq!(f(&0.0), "0");
        // 0.01 apart at most 8 ticks: 2 decimals; 0.005 apart: 3.
        let f = tick_format((0.0, 0.05));
        assert_eq!(f(&0.02), "0.02");
        let f = tick_format((0.0, 0.03));
        assert_eq!(f(&0.005), "0.005");
        let f = tick_format((1000.0, 5000.0));
        assert_eq!(f(&2500.0), "2500");
        let f = tick_format((0.0, 2e-5));
        assert_eq!(f(&1.5e-5), "1.5e-5");
    }
}
