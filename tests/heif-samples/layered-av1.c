/* Writes one still picture as an AV1 temporal unit of three spatial layers (1/4, 1/2 and
 * the full size), each layer predicted from the one below, as libaom's SVC encoder makes
 * them: the payload of tests/heif-samples/quadrants-3layers.obu.
 *
 *   gcc -O1 -o layered-av1 layered-av1.c -laom   (Debian 12: libaom-dev 3.6)
 *   ./layered-av1 1436 730 quadrants-3layers.obu
 *
 * The picture is the four quadrants of darkroom's samples, split at the centre: red (top
 * left), green (top right), blue (bottom left), white (bottom right), BT.601 limited range.
 */
#include <aom/aom_encoder.h>
#include <aom/aomcx.h>
#include <stdio.h>
#include <stdlib.h>

static const unsigned char YUV[4][3] = {{81, 90, 240}, {145, 54, 34}, {41, 240, 110}, {235, 128, 128}};

static void draw(aom_image_t *img, int w, int h) {
  for (int plane = 0; plane < 3; plane++) {
    int shift = plane ? 1 : 0, pw = (w + shift) >> shift, ph = (h + shift) >> shift;
    for (int y = 0; y < ph; y++)
      for (int x = 0; x < pw; x++) {
        int quadrant = ((y << shift) >= h / 2) * 2 + ((x << shift) >= w / 2);
        img->planes[plane][y * img->stride[plane] + x] = YUV[quadrant][plane];
      }
  }
}

static void fail(aom_codec_ctx_t *codec, const char *what) {
  fprintf(stderr, "%s: %s\n", what, aom_codec_error(codec));
  exit(1);
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s WIDTH HEIGHT OUT.obu\n", argv[0]);
    return 2;
  }
  int w = atoi(argv[1]), h = atoi(argv[2]);
  aom_image_t raw;
  if (!aom_img_alloc(&raw, AOM_IMG_FMT_I420, w, h, 1)) return 1;
  draw(&raw, w, h);
  aom_codec_iface_t *iface = aom_codec_av1_cx();
  aom_codec_enc_cfg_t cfg;
  if (aom_codec_enc_config_default(iface, &cfg, AOM_USAGE_REALTIME)) return 1;
  cfg.g_w = w;
  cfg.g_h = h;
  cfg.g_timebase.num = 1;
  cfg.g_timebase.den = 30;
  cfg.g_lag_in_frames = 0;
  cfg.g_threads = 1;
  cfg.rc_end_usage = AOM_CBR;
  cfg.rc_target_bitrate = 3000;
  cfg.rc_min_quantizer = 20;
  cfg.rc_max_quantizer = 40;
  aom_codec_ctx_t codec;
  if (aom_codec_enc_init(&codec, iface, &cfg, 0)) fail(&codec, "init");
  aom_codec_control(&codec, AOME_SET_CPUUSED, 9);
  aom_svc_params_t svc = {0};
  svc.number_spatial_layers = 3;
  svc.number_temporal_layers = 1;
  svc.framerate_factor[0] = 1;
  for (int i = 0; i < 3; i++) {
    svc.max_quantizers[i] = 40;
    svc.min_quantizers[i] = 20;
    svc.scaling_factor_num[i] = 1;
    svc.scaling_factor_den[i] = 4 >> i;
    svc.layer_target_bitrate[i] = 1000 * (i + 1);
  }
  if (aom_codec_control(&codec, AV1E_SET_SVC_PARAMS, &svc)) fail(&codec, "svc");
  FILE *out = fopen(argv[3], "wb");
  if (!out) return 1;
  for (int layer = 0; layer < 3; layer++) {
    aom_svc_layer_id_t id = {layer, 0};
    aom_codec_control(&codec, AV1E_SET_SVC_LAYER_ID, &id);
    aom_svc_ref_frame_config_t refs = {0};
    for (int i = 0; i < 7; i++) refs.ref_idx[i] = layer ? layer - 1 : 0;
    refs.reference[0] = layer > 0; /* LAST: the layer below, upscaled */
    refs.refresh[layer] = 1;
    aom_codec_control(&codec, AV1E_SET_SVC_REF_FRAME_CONFIG, &refs);
    if (aom_codec_encode(&codec, &raw, 0, 1, layer ? 0 : AOM_EFLAG_FORCE_KF)) fail(&codec, "encode");
    aom_codec_iter_t iter = NULL;
    const aom_codec_cx_pkt_t *pkt;
    while ((pkt = aom_codec_get_cx_data(&codec, &iter)))
      if (pkt->kind == AOM_CODEC_CX_FRAME_PKT) {
        fwrite(pkt->data.frame.buf, 1, pkt->data.frame.sz, out);
        printf("layer %d: %zu bytes\n", layer, pkt->data.frame.sz);
      }
  }
  fclose(out);
  aom_codec_destroy(&codec);
  return 0;
}
