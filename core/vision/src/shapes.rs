//! Simple synthetic scenes for a visual task that a tiny model can learn: filled circles and
//! squares of a few colours on a white canvas, at most one shape in each quadrant (so each shape
//! falls in one merged patch of a Qwen-VL tower at 56 × 56 pixels), encoded as PNG.

use std::io::Cursor;

use crate::error::{Result, VisionError};

/// The colours a shape can take: its name and RGB value.
pub const COLOURS: [(&str, [u8; 3]); 4] =
    [("red", [220, 40, 40]), ("green", [40, 170, 60]), ("blue", [40, 70, 220]), ("yellow", [230, 200, 40])];

/// A shape's outline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Circle,
    Square,
}

/// One shape of a scene: its outline, colour (an index into [`COLOURS`]) and quadrant
/// (0 top left, 1 top right, 2 bottom left, 3 bottom right).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub kind: Kind,
    pub colour: usize,
    pub quadrant: usize,
}

/// The scene's `side × side` RGB pixels, row by row: each shape a disc or square of radius
/// `side / 6` centred in its quadrant.
pub fn render(shapes: &[Shape], side: u32) -> Vec<u8> {
    let mut pixels = vec![255u8; (side * side * 3) as usize];
    let half = side as i64 / 2;
    let r = side as i64 / 6;
    for s in shapes {
        let (cx, cy) = ((s.quadrant % 2) as i64 * half + half / 2, (s.quadrant / 2) as i64 * half + half / 2);
        let rgb = COLOURS[s.colour % COLOURS.len()].1;
        for y in (cy - r).max(0)..(cy + r + 1).min(side as i64) {
            for x in (cx - r).max(0)..(cx + r + 1).min(side as i64) {
                let inside = match s.kind {
                    Kind::Circle => (x - cx).pow(2) + (y - cy).pow(2) <= r * r,
                    Kind::Square => true,
                };
                if inside {
                    let at = ((y * side as i64 + x) * 3) as usize;
                    pixels[at..at + 3].copy_from_slice(&rgb);
                }
            }
        }
    }
    pixels
}

/// The scene as a PNG file's bytes.
pub fn png(shapes: &[Shape], side: u32) -> Result<Vec<u8>> {
    let image = image::RgbImage::from_raw(side, side, render(shapes, side))
        .ok_or_else(|| VisionError::Encode(format!("{side} x {side} pixels do not fit the buffer")))?;
    let mut out = Cursor::new(Vec::new());
    image.write_to(&mut out, image::ImageFormat::Png).map_err(|e| VisionError::Encode(e.to_string()))?;
    Ok(out.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_drawn_in_their_quadrants_and_round_trip_through_png() {
        let scene = [
            Shape { kind: Kind::Circle, colour: 0, quadrant: 0 },
            Shape { kind: Kind::Square, colour: 2, quadrant: 3 },
        ];
        let px = render(&scene, 56);
        let at = |x: usize, y: usize| &px[(y * 56 + x) * 3..(y * 56 + x) * 3 + 3];
        assert_eq!(at(14, 14), COLOURS[0].1); // the circle's centre
        assert_eq!(at(14 - 9, 14 - 9), [255, 255, 255]); // outside the disc, inside its square
        assert_eq!(at(42 - 9, 42 - 9), COLOURS[2].1); // the square's corner
        assert_eq!(at(42, 14), [255, 255, 255]); // an empty quadrant
        let decoded = crate::load_bytes(&png(&scene, 56).unwrap(), "scene").unwrap();
        assert_eq!((decoded.width, decoded.height), (56, 56));
        assert_eq!(decoded.data, px);
    }
}
