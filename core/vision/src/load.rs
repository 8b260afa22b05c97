//! Decoding images to 8-bit RGB as transformers' `load_image` (and verl's `process_image`) do
//! with Pillow: EXIF orientation applied, then `convert("RGB")` — grey and palette images
//! expanded, alpha dropped (not composited: the colour under a transparent pixel is kept).

use std::io::Cursor;
use std::path::Path;

use image::{DynamicImage, GrayImage, ImageDecoder, ImageFormat, ImageReader, RgbImage as Rgb8};

use crate::error::{Result, VisionError};

/// Pillow refuses images of more pixels than this (`2 · Image.MAX_IMAGE_PIXELS`) as decompression
/// bombs; so does this loader, before decoding.
pub const MAX_PIXELS: u64 = 2 * 89_478_485;

/// An 8-bit RGB image, rows top to bottom, pixels `[r, g, b]` interleaved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: usize,
    pub height: usize,
    /// `height · width · 3` bytes.
    pub data: Vec<u8>,
}

impl RgbImage {
    /// An image of `width × height` from interleaved RGB bytes.
    pub fn new(width: usize, height: usize, data: Vec<u8>) -> Option<Self> {
        (data.len() == width * height * 3 && width > 0 && height > 0).then_some(RgbImage { width, height, data })
    }
}

/// The largest image file read (far above any photo a model takes, whose pixels are limited by
/// [`MAX_PIXELS`]); checked before the file is read, so a path naming a device or a huge file
/// cannot make the reader allocate without bound.
pub const MAX_FILE_BYTES: u64 = 256 << 20;

/// Decodes the image file at `path` (PNG, JPEG, WebP, GIF's first frame, BMP): a regular file of
/// at most [`MAX_FILE_BYTES`].
pub fn load_path(path: &Path) -> Result<RgbImage> {
    load_bytes(&read_file(path)?, &path.display().to_string())
}

/// The bytes of the image file at `path`: a regular file of at most [`MAX_FILE_BYTES`].
pub fn read_file(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let io = |source| VisionError::Io { path: path.to_path_buf(), source };
    let file = std::fs::File::open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    let size_err = |message: String| VisionError::Size { source_name: path.display().to_string(), message };
    if !meta.is_file() {
        return Err(size_err("not a regular file".into()));
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(size_err(format!("{} bytes, more than an image file may have ({MAX_FILE_BYTES})", meta.len())));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(size_err(format!("grew past {MAX_FILE_BYTES} bytes while read")));
    }
    Ok(bytes)
}

/// Decodes encoded image bytes; `name` says where they came from in errors.
pub fn load_bytes(bytes: &[u8], name: &str) -> Result<RgbImage> {
    let err = |e: image::ImageError| VisionError::Decode { source_name: name.to_string(), message: e.to_string() };
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| VisionError::Decode { source_name: name.to_string(), message: e.to_string() })?;
    let format = reader.format();
    let mut decoder = reader.into_decoder().map_err(err)?;
    let (w, h) = decoder.dimensions();
    if u64::from(w) * u64::from(h) > MAX_PIXELS {
        return Err(VisionError::Size {
            source_name: name.to_string(),
            message: format!("{w}×{h} pixels exceed Pillow's decompression-bomb limit of {MAX_PIXELS}"),
        });
    }
    let orientation = decoder.orientation().map_err(err)?;
    let jpeg = match format {
        Some(ImageFormat::Jpeg) => decode_jpeg(bytes, name)?,
        _ => None,
    };
    let mut image = match jpeg {
        Some(image) => image,
        None => DynamicImage::from_decoder(decoder).map_err(err)?,
    };
    image.apply_orientation(orientation);
    let rgb = image.into_rgb8();
    let (width, height) = (rgb.width() as usize, rgb.height() as usize);
    let data = rgb.into_raw();
    RgbImage::new(width, height, data)
        .ok_or_else(|| VisionError::Size { source_name: name.to_string(), message: "the image is empty".into() })
}

/// A baseline or progressive JPEG's RGB or grey pixels through `jpeg-decoder`, whose inverse DCT
/// and fancy chroma upsampling come within 3 levels of libjpeg-turbo's (Pillow's); `None` for
/// other colour types (CMYK), which the `image` crate decodes.
fn decode_jpeg(bytes: &[u8], name: &str) -> Result<Option<DynamicImage>> {
    let mut decoder = jpeg_decoder::Decoder::new(Cursor::new(bytes));
    let pixels =
        decoder.decode().map_err(|e| VisionError::Decode { source_name: name.to_string(), message: e.to_string() })?;
    let Some(info) = decoder.info() else { return Ok(None) };
    let (w, h) = (u32::from(info.width), u32::from(info.height));
    Ok(match info.pixel_format {
        jpeg_decoder::PixelFormat::RGB24 => Rgb8::from_raw(w, h, pixels).map(DynamicImage::ImageRgb8),
        jpeg_decoder::PixelFormat::L8 => GrayImage::from_raw(w, h, pixels).map(DynamicImage::ImageLuma8),
        _ => None,
    })
}
